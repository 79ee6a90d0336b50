"""Llama 3.1 / 3.2 JSON tool calls (vLLM's "llama3_json" parser): the whole output, after an
optional `<|python_tag|>`, is `{"name": ..., "parameters": {...}}`, or several joined by `;`."""

from __future__ import annotations

from enum import Enum

from jvllm.entrypoints.openai.tool_parsers.base import ToolParser
from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class _State(Enum):
    START = "start"  # before the first call: whitespace and the optional tag
    OPEN = "open"  # before a call's JSON
    CALL = "call"  # in the JSON object
    CLOSE = "close"  # after a call's JSON: `;` or the end


class Llama3JsonToolParser(ToolParser):
    """With no marker around the calls, a call needs "parameters" (or "arguments") as well as
    a "name", so a plain JSON answer is less often taken for one; any output that is not calls
    is content. The output is held back until its first text shows which it is."""

    require_arguments = True

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._state = _State.START

    def _advance(self, is_final: bool) -> None:
        text = self._text
        while True:
            pos = skip_whitespace(text, self._pos)
            if self._state is _State.START:
                if text.startswith(PYTHON_TAG, pos):
                    self._hold(pos + len(PYTHON_TAG))
                elif not is_final and PYTHON_TAG.startswith(text[pos : pos + len(PYTHON_TAG)]):
                    return  # blank, or may be the start of the tag
                self._state = _State.OPEN
            elif self._state is _State.OPEN:
                if pos == len(text) and not is_final:
                    return
                if not text.startswith("{", pos):
                    raise ValueError("the output is not a JSON tool call")
                self._start_call(pos)
                self._state = _State.CALL
            elif self._state is _State.CALL:
                if not self._read_call_to_its_end(is_final):
                    return
                self._state = _State.CLOSE
            elif pos == len(text):
                return  # the end, or the `;` of a next call may follow
            elif text[pos] == ";":
                self._hold(pos + 1)
                self._state = _State.OPEN
            else:
                raise ValueError("text after a tool call's JSON")
