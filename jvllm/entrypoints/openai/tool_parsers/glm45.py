"""GLM-4.5 / GLM-4.6 tool calls (vLLM's "glm45" parser): content, then blocks
`<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>` (GLM-4.7
writes them without the newlines). A value is raw text: kept as it is where the parameter's
schema in the request's tools says "string", else read as JSON, else as a Python literal, else
kept as text (vLLM's rules); keys and values are stripped of surrounding whitespace."""

from __future__ import annotations

import json
import math
from enum import Enum

from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace
from jvllm.entrypoints.openai.tool_parsers.qwen3_coder import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    Qwen3CoderToolParser,
    dumps_json,
    parameter_schemas,
    python_literal,
)

KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
# A name ends at its line's end, or where the first argument or the block's end begins.
_NAME_ENDS = ("\n", KEY_START, TOOL_CALL_END)


class _State(Enum):
    CONTENT = "content"  # text outside the blocks
    NAME = "name"  # after <tool_call>
    ARGUMENTS = "arguments"  # between arguments: <arg_key> or </tool_call> next
    KEY = "key"  # in <arg_key>K
    VALUE_OPEN = "value_open"  # after </arg_key>: <arg_value> next
    VALUE = "value"  # in <arg_value>V


class Glm45ToolParser(Qwen3CoderToolParser):
    """Qwen3-Coder's parser (its handling between arguments, its typing helpers) over GLM's
    markup. Content is all text outside the blocks. The name goes out once it ends, each argument
    once its </arg_value> came (its type is known only then), and `}` at </tool_call>; a block
    whose </tool_call> the output lacks after a whole argument ends there. A repeated key is
    kept twice, as the JSON formats keep one, since the first has gone out."""

    # vLLM turns off skip_special_tokens for this parser's requests: the markers may be
    # special tokens of the model's tokenizer.
    reads_special_tokens = True

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._state = _State.CONTENT  # this format's states
        self._key = ""

    def _advance(self, is_final: bool) -> None:
        text = self._text
        while True:
            pos = skip_whitespace(text, self._pos)
            if self._state is _State.CONTENT:
                if not self._content_until(TOOL_CALL_START, is_final):
                    return
                self._state = _State.NAME
            elif self._state is _State.NAME:
                end = self._find_end(_NAME_ENDS, is_final, "a function's name")
                if end is None:
                    return
                index, marker = end
                self._name, self._arguments = text[self._pos : index].strip(), ""
                if not self._name:
                    raise ValueError(f"{TOOL_CALL_START} names no function")
                self._hold(index + len(marker) if marker == "\n" else index)
                self._send_call(self._name, "", None)
                self._state = _State.ARGUMENTS
            elif self._state is _State.ARGUMENTS:
                marker = self._between_arguments(pos, is_final, KEY_START, TOOL_CALL_END)
                if not marker:
                    return
                self._state = _State.CONTENT if marker == TOOL_CALL_END else _State.KEY
            elif self._state is _State.KEY:
                end = self._find_end((KEY_END,), is_final, "an argument's key")
                if end is None:
                    return
                self._key = text[self._pos : end[0]].strip()
                self._hold(end[0] + len(KEY_END))
                self._state = _State.VALUE_OPEN
            elif self._state is _State.VALUE_OPEN:
                if self._expect(pos, (VALUE_START,), is_final) is None:
                    return
                self._hold(pos + len(VALUE_START))
                self._state = _State.VALUE
            else:
                end = self._find_end((VALUE_END,), is_final, "an argument's value")
                if end is None:
                    return
                value = self._typed(text[self._pos : end[0]].strip())
                piece = f"{dumps_json(self._key)}: {dumps_json(value)}"
                self._arguments += ("{" if not self._arguments else ", ") + piece
                self._send_call(self._name, self._arguments, None)
                self._hold(end[0] + len(VALUE_END))
                self._state = _State.ARGUMENTS

    def _find_end(self, markers: tuple[str, ...], is_final: bool, what: str):
        """(index, marker) of the first of `markers` from pos; None while none has come (a
        ValueError naming `what` when the output is complete)."""
        found = [(i, m) for m in markers if (i := self._text.find(m, self._pos)) >= 0]
        if found:
            return min(found)
        if is_final:
            raise ValueError(f"the output ends in {what}")
        return None

    def _typed(self, value: str):
        schema = parameter_schemas(self.tools.get(self._name)).get(self._key)
        if isinstance(schema, dict) and schema.get("type") == "string":
            return value
        try:
            parsed = json.loads(value)
        except ValueError:
            return python_literal(value)
        is_finite = not isinstance(parsed, float) or math.isfinite(parsed)
        return parsed if is_finite else value  # NaN has no JSON
