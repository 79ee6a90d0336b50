"""Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls (vLLM's "hermes" parser): content, then blocks
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

from enum import Enum

from jvllm.entrypoints.openai.tool_parsers.base import ToolParser
from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class _State(Enum):
    CONTENT = "content"  # text outside the blocks
    OPEN = "open"  # after <tool_call>, before the JSON
    CALL = "call"  # in the JSON object
    CLOSE = "close"  # after the JSON, before </tool_call>


class Hermes2ProToolParser(ToolParser):
    """Content is all text outside the blocks. A block may lack all or the end of its
    `</tool_call>` when the model stopped right after the JSON; a call without "arguments"
    has "{}"."""

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._state = _State.CONTENT

    def _advance(self, is_final: bool) -> None:
        text = self._text
        while True:
            if self._state is _State.CONTENT:
                if not self._content_until(TOOL_CALL_START, is_final):
                    return
                self._state = _State.OPEN
            elif self._state is _State.OPEN:
                pos = skip_whitespace(text, self._pos)
                if pos == len(text):
                    if is_final:
                        raise ValueError(f"nothing after {TOOL_CALL_START}")
                    return
                if text[pos] != "{":
                    raise ValueError(f"{TOOL_CALL_START} is not followed by a JSON object")
                self._start_call(pos)
                self._state = _State.CALL
            elif self._state is _State.CALL:
                if not self._read_call_to_its_end(is_final):
                    return
                self._state = _State.CLOSE
            else:
                pos = skip_whitespace(text, self._pos)
                end_tag = text[pos : pos + len(TOOL_CALL_END)]
                if end_tag == TOOL_CALL_END:
                    self._drop(pos + len(TOOL_CALL_END))
                    self._state = _State.CONTENT
                elif TOOL_CALL_END.startswith(end_tag) and pos + len(end_tag) == len(text):
                    return  # may be the start of </tool_call>, or the model stopped there
                else:
                    raise ValueError(f"text between a tool call's JSON and {TOOL_CALL_END}")
