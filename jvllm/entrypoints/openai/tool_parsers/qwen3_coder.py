"""Qwen3-Coder tool calls (vLLM's "qwen3_coder" parser): content, then blocks
`<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>`.
A value is raw text, typed by the parameter's JSON schema in the request's tools."""

from __future__ import annotations

import ast
import json
import math
from enum import Enum

from jvllm.entrypoints.openai.tool_parsers.base import ToolParser
from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
# Schema "type" spellings, as vLLM reads them.
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float")
_BOOLEAN_TYPES = ("boolean", "bool", "binary")
_JSON_TYPES = ("object", "array", "arr")
_JSON_PREFIXES = ("dict", "list")


class _State(Enum):
    CONTENT = "content"  # text outside the blocks
    OPEN = "open"  # after <tool_call>: <function= next
    NAME = "name"  # in <function=NAME>
    PARAMETERS = "parameters"  # between parameters: <parameter= or </function> next
    VALUE = "value"  # in <parameter=P>VALUE
    CLOSE = "close"  # after </function>: </tool_call> next


class Qwen3CoderToolParser(ToolParser):
    """Content is all text outside the blocks. The name goes out at its `>`, each parameter
    once its value ends (its type, so its JSON, is known only then), and `}` at </function>.
    A block may lack its </function> and </tool_call> when the model stopped after a whole
    parameter, and its </tool_call> before the next block; a value cut off by the end of the output is malformed. A repeated parameter is
    kept twice, as the JSON formats keep a repeated key, since the first one has gone out."""

    # The format's markup (MiniMax-M2's parser sets its own): a name ends at `name_end`, a
    # parameter's name at `parameter_name_end`; `calls_share_blocks`: a block may hold
    # several functions.
    tool_call_start, tool_call_end = TOOL_CALL_START, TOOL_CALL_END
    function_start, function_end = FUNCTION_START, FUNCTION_END
    parameter_start, parameter_end = PARAMETER_START, PARAMETER_END
    name_end = parameter_name_end = ">"
    calls_share_blocks = False

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._state = _State.CONTENT
        self._name = ""
        self._arguments = ""  # canonical JSON of the parameters so far, without its `}`
        self._value_start = 0
        self._search_from = 0  # no value end starts before it

    def _advance(self, is_final: bool) -> None:
        text = self._text
        while True:
            pos = skip_whitespace(text, self._pos)
            if self._state is _State.CONTENT:
                if not self._content_until(self.tool_call_start, is_final):
                    return
                self._state = _State.OPEN
            elif self._state is _State.OPEN:
                if not self._expect(pos, (self.function_start,), is_final):
                    return
                self._hold(pos + len(self.function_start))
                self._state = _State.NAME
            elif self._state is _State.NAME:
                end = text.find(self.name_end, self._pos)
                if end < 0:
                    if is_final:
                        raise ValueError("the output ends in a function's name")
                    return
                self._name, self._arguments = text[self._pos : end], ""
                if not self._name:
                    raise ValueError(f"{self.function_start}{self.name_end} names no function")
                self._hold(end + len(self.name_end))
                self._send_call(self._name, "", None)
                self._state = _State.PARAMETERS
            elif self._state is _State.PARAMETERS:
                start, end = self.parameter_start, self.function_end
                marker = self._between_arguments(pos, is_final, start, end)
                if not marker:
                    return
                if marker == self.function_end:
                    self._state = _State.CLOSE
                else:
                    self._state = _State.VALUE
                    self._value_start = self._search_from = self._pos
            elif self._state is _State.VALUE:
                if not self._read_parameter(is_final):
                    return
                self._state = _State.PARAMETERS
            else:
                # The block's end, the next block if this lacks its end, or the block's next
                # function where blocks hold several.
                ends = (self.tool_call_end, self.tool_call_start)
                ends += (self.function_start,) if self.calls_share_blocks else ()
                marker = self._expect(pos, ends, is_final, may_end=True)
                if marker is None:
                    return
                if marker == self.function_start:
                    self._drop(pos)
                    self._hold(pos + len(marker))
                    self._state = _State.NAME
                    continue
                self._drop(pos + len(marker) if marker == self.tool_call_end else pos)
                self._state = _State.CONTENT

    def _between_arguments(self, pos: int, is_final: bool, start: str, end: str) -> str | None:
        """At text[pos], a call's next argument or its end: `start` (moved past), `end` (the
        call sent whole, moved past), "" where the output ended after an argument (the call
        sent whole), None while the text does not tell yet."""
        closed = (self._arguments or "{") + "}"
        if pos == len(self._text) and is_final:  # the model stopped after an argument
            self._send_call(self._name, closed, len(self._text))
            return ""
        marker = self._expect(pos, (start, end), is_final)
        if marker == end:
            self._send_call(self._name, closed, pos + len(end))
        elif marker == start:
            self._hold(pos + len(start))
        return marker

    def _read_parameter(self, is_final: bool) -> bool:
        """Reads `P>VALUE` up to the value's end and sends the parameter; True once sent."""
        text = self._text
        # A value ends at its parameter's end, or where the next parameter or the function's
        # end begins.
        value_ends = (self.parameter_end, self.parameter_start, self.function_end)
        ends = [(text.find(end, self._search_from), end) for end in value_ends]
        found = [(index, end) for index, end in ends if index >= 0]
        if not found:
            if is_final:
                raise ValueError("the output ends inside a parameter's value")
            self._search_from = max(self._value_start, len(text) - len(self.parameter_end) + 1)
            return False
        index, end = min(found)
        header, separator, value = text[self._value_start : index].partition(
            self.parameter_name_end
        )
        if not separator:
            raise ValueError(f"{self.parameter_start} without its `{self.parameter_name_end}`")
        value = value.removeprefix("\n").removesuffix("\n")
        typed = _typed_value(value, parameter_schemas(self.tools.get(self._name)).get(header))
        piece = f"{dumps_json(header)}: {dumps_json(typed)}"
        self._arguments += ("{" if not self._arguments else ", ") + piece
        self._send_call(self._name, self._arguments, None)
        self._hold(index + len(end) if end == self.parameter_end else index)
        return True


def dumps_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def parameter_schemas(parameters: dict | None) -> dict:
    """Parameter name -> schema: the "properties", or as vLLM does, the parameters schema
    itself when it has none."""
    if not isinstance(parameters, dict):
        return {}
    properties = parameters.get("properties", parameters)
    return properties if isinstance(properties, dict) else {}


def _typed_value(value: str, schema):
    """A parameter's raw text as the JSON value its schema's "type" asks for, vLLM's rules: a
    text that does not convert stays a string (a boolean is then false)."""
    if value.lower() == "null":
        return None
    if schema is None:  # not a declared parameter
        return value
    has_type = isinstance(schema, dict) and "type" in schema
    kind = str(schema["type"]).strip().lower() if has_type else "string"
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(_NUMBER_PREFIXES):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in _BOOLEAN_TYPES:
        return value.lower() == "true"
    if kind in _JSON_TYPES or kind.startswith(_JSON_PREFIXES):
        try:
            return json.loads(value)
        except ValueError:
            pass
    return python_literal(value)


def python_literal(value: str):
    """The value of a Python literal's text when JSON can hold it, else the text."""
    try:
        literal = ast.literal_eval(value)
        json.dumps(literal)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value
    return literal
