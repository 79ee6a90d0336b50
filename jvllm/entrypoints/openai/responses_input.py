"""The Responses API's request as the chat API's: `instructions` and `input` items as chat
messages, its flat function tools and tool_choice as chat tools, so that /v1/responses renders,
constrains and parses calls exactly as /v1/chat/completions does (tool_calls.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from jvllm.entrypoints.chat import ContentError, part_text, text_content
from jvllm.entrypoints.openai.protocol import OpenAIError, ResponsesRequest

# The roles of message items, as the chat template sees them.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_messages(request: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages, text content joined: message items by role,
    `function_call` items as an assistant's tool_calls (consecutive ones in one message),
    `function_call_output` items as tool messages. `reasoning` items are dropped: templates
    leave earlier turns' thoughts out. Any other item is a 400 naming it."""
    messages = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        if not request.input:
            raise OpenAIError("input must not be empty", param="input")
        return [*messages, {"role": "user", "content": request.input}]
    if not request.input:
        raise OpenAIError("input must not be empty", param="input")
    for i, item in enumerate(request.input):
        if not isinstance(item, dict):
            raise OpenAIError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            _add_call(messages, i, item)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
                raise OpenAIError(
                    f"input[{i}]: a function_call_output needs a call_id and a string output",
                    param="input",
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind != "reasoning":
            raise OpenAIError(
                f"input[{i}] is a {kind!r} item; jvllm takes message, function_call, "
                "function_call_output and reasoning items",
                param="input",
            )
    try:
        return text_content(messages)
    except ValueError as e:
        raise OpenAIError(str(e), param="input") from None


def chat_tools_request(request: ResponsesRequest) -> SimpleNamespace:
    """The request's tools as tool_calls.plan_tools reads them from a chat request: each flat
    {"type": "function", "name", "description", "parameters"} nested under "function", and a
    named tool_choice {"type": "function", "name"} likewise."""
    tools = []
    for i, tool in enumerate(request.tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise OpenAIError(
                f"tools[{i}] is a {kind!r} tool; jvllm serves function tools only "
                '({"type": "function", "name": ..., "parameters": {...}})',
                param="tools",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    choice = request.tool_choice
    if not tools and choice in ("auto", "none"):
        choice = None  # the API's default, with no tools: nothing to choose from
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise OpenAIError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                '"name": ...}',
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return SimpleNamespace(
        tools=tools or None, tool_choice=choice, parallel_tool_calls=request.parallel_tool_calls
    )


def _message(i: int, item: dict) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise OpenAIError(f"input[{i}] has role {role!r}; allowed: {sorted(_ROLES)}", param="input")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(
                    f"input[{i}].content[{j}] is a {kind!r} part; jvllm takes text parts "
                    f"({', '.join(_TEXT_PARTS)})",
                    param="input",
                )
            try:
                text = part_text(part, f"input[{i}].content[{j}]")
            except ContentError as e:
                raise OpenAIError(str(e), param="input") from None
            parts.append({"type": "text", "text": text})
        content = parts
    return {"role": _ROLES[role], "content": content}


def _add_call(messages: list[dict], i: int, item: dict) -> None:
    """A function_call item onto the assistant message just before it (the same turn's text or
    calls), or a new one; its arguments must be a JSON object's text, as the template writes
    them as an object."""
    name, arguments = item.get("name"), item.get("arguments", "{}")
    try:
        is_object = isinstance(json.loads(arguments), dict)
    except (TypeError, ValueError):
        is_object = False
    if not is_object:
        raise OpenAIError(
            f"input[{i}]: a function_call's arguments must be a JSON object as a string",
            param="input",
        )
    if not isinstance(name, str) or not isinstance(item.get("call_id"), str):
        raise OpenAIError(f"input[{i}]: a function_call needs a name and a call_id", param="input")
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":  # the turn's text, or calls, before it
        last["tool_calls"] = [*(last.get("tool_calls") or []), call]
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
