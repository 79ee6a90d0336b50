"""The chat API's tools: `tools` and `tool_choice` checked, the constraint that forces a call
("required" or a named function, as vLLM builds it), and a reply as OpenAI `tool_calls`, whole
or streamed. "auto" reads calls out of free text with a tool call parser (tool_parsers/)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from jvllm.entrypoints.openai.protocol import OpenAIError
from jvllm.entrypoints.openai.structured import checked
from jvllm.entrypoints.openai.tool_parsers import ToolParser
from jvllm.entrypoints.openai.tool_parsers.base import new_call_id
from jvllm.sampling_params import StructuredOutputsParams
from jvllm.structured_output.json_schema import rebase_refs

# A function without `parameters` takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one request treats its tools: "none" (text), "auto" (parsed out of the text),
    "required" (a JSON list of calls) or "named" (the arguments of `name`)."""

    mode: str
    name: str | None = None
    parser: type[ToolParser] | None = None
    tools: dict[str, dict] | None = None  # "auto": name -> parameters schema, for the parser
    constraint: StructuredOutputsParams | None = None


def plan_tools(request, parser: type[ToolParser] | None) -> ToolPlan:
    """The request's ToolPlan; a 400 naming the field for tools or a tool_choice that cannot
    work (unknown function, "auto" on a server without a parser, ...). `parser`: the server's
    --tool-call-parser, None without --enable-auto-tool-choice."""
    functions = _functions(request.tools)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return ToolPlan("none")
    if not functions:
        raise OpenAIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "auto":
        if parser is None:
            raise OpenAIError(
                '"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                '--tool-call-parser NAME; or send tool_choice "required", a named function, '
                'or "none"',
                param="tool_choice",
            )
        return ToolPlan("auto", parser=parser, tools=functions)
    if choice == "required":
        return ToolPlan("required", constraint=_required(functions, request.parallel_tool_calls))
    name = _named(choice)
    if name not in functions:
        raise OpenAIError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(functions)})",
            param="tool_choice",
        )
    return ToolPlan("named", name, constraint=checked("tools", {"json": functions[name]}))


def _functions(tools: list | None) -> dict[str, dict]:
    """name -> parameters schema of each function tool."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise OpenAIError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}',
                param="tools",
            )
        parameters = function.get("parameters") or _NO_PARAMETERS
        if not isinstance(parameters, dict):
            raise OpenAIError(
                f"tools[{i}].function.parameters must be a JSON schema object", param="tools"
            )
        functions[function["name"]] = parameters
    return functions


def _named(choice) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}',
            param="tool_choice",
        )
    return function["name"]


def _required(functions: dict[str, dict], parallel: bool | None) -> StructuredOutputsParams:
    """A JSON list of {"name", "parameters"} calls, each one of the tools (vLLM's schema).
    Each tool's schema is checked alone first: in the list's anyOf, llguidance drops an
    unsatisfiable one without a word, and its calls could never come."""
    for name, schema in functions.items():
        checked(f"tools ({name!r})", {"json": schema}, param="tools")
    call = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                # A tool's $refs ("#/$defs/A") point into its own schema: now placed here.
                "parameters": rebase_refs(schema, f"#/items/anyOf/{i}/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, (name, schema) in enumerate(functions.items())
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if parallel is False:
        schema["maxItems"] = 1
    return checked("tools", {"json": schema})


def _call(name: str, arguments: str) -> dict:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def reply(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole reply; a forced call that did not complete (e.g. cut
    at max_tokens) stays text."""
    if plan.mode == "named":
        return None, [_call(plan.name, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [
            _call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls
        ]
    if plan.mode == "auto":
        extracted = plan.parser(tools=plan.tools).extract_tool_calls(text)
        if extracted.tools_called:
            return extracted.content, extracted.tool_calls
    return text, []


class ToolCallStream:
    """One streamed choice's text deltas as chunk deltas carrying its calls: "auto" through the
    parser, "named" as argument pieces of one call, "required" as whole calls at the end (its
    list is only known to be calls once it closes)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.called = False  # some tool call went out
        self._text = ""
        self._parser = plan.parser(tools=plan.tools) if plan.mode == "auto" else None

    def feed(self, delta_text: str) -> dict | None:
        previous, self._text = self._text, self._text + delta_text
        if self.plan.mode == "named":
            if not delta_text:
                return None
            if not self.called:
                self.called = True
                call = {"index": 0, **_call(self.plan.name, delta_text)}
                return {"tool_calls": [call]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]}
        if self.plan.mode == "required":
            return None
        delta = self._parser.extract_tool_calls_streaming(previous, self._text, delta_text)
        self.called |= bool(delta and delta.get("tool_calls"))
        return delta

    def finish(self) -> dict | None:
        if self.plan.mode == "auto":
            delta = self._parser.finish()
            self.called |= bool(delta and delta.get("tool_calls"))
            return delta
        if self.plan.mode == "required":
            content, calls = reply(self.plan, self._text)
            if not calls:
                return {"content": content} if content else None
            self.called = True
            return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        return None
