"""IBM Granite 3.x tool calls (vLLM's "granite" parser): the whole output, after an optional
`<|tool_call|>` (Granite 3.0's token) and an optional `<tool_call>` (Granite 3.1's string), is
a JSON list `[{"name": ..., "arguments": {...}}, ...]`."""

from __future__ import annotations

from jvllm.entrypoints.openai.tool_parsers.json_calls import JsonCallListParser
from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace

MARKERS = ("<|tool_call|>", "<tool_call>")  # each optional, in this order


class GraniteToolParser(JsonCallListParser):
    """Output that is not such a list is all content; a list leaves none, so whitespace is
    all that may follow it. The output is held back until its first text shows which it is."""

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._num_markers_read = 0  # of MARKERS, passed over or found absent
        self._is_list_read = False

    def _advance(self, is_final: bool) -> None:
        text = self._text
        while self._num_markers_read < len(MARKERS):
            pos = skip_whitespace(text, self._pos)
            marker = MARKERS[self._num_markers_read]
            if text.startswith(marker, pos):
                self._hold(pos + len(marker))
            elif not is_final and marker.startswith(text[pos : pos + len(marker)]):
                return  # blank, or may be the start of the marker
            self._num_markers_read += 1
        if not self._is_list_read:
            pos = skip_whitespace(text, self._pos)
            if self._list_state is None:
                if pos == len(text) and not is_final:
                    return
                if not text.startswith("[", pos):
                    raise ValueError("the output is not a list of tool calls")
            if not self._read_list(is_final):
                return
            self._is_list_read = True
        if text[self._pos :].strip():
            raise ValueError("text after the list of tool calls")
        self._drop(len(text))
