"""Pieces shared by the formats whose calls are JSON: one JSON object read from a growing text
(Mistral's bare arguments object), and a `[{call}, {call}]` list of call objects (Granite's,
Mistral's older form)."""

from __future__ import annotations

from enum import Enum

from jvllm.entrypoints.openai.tool_parsers.base import ToolParser
from jvllm.entrypoints.openai.tool_parsers.partial_json import (
    dumps,
    loads,
    read_string,
    scan_token,
    skip_whitespace,
)

_DEPTH_CHANGE = {"{": 1, "[": 1, "}": -1, "]": -1}


class ValueReader:
    """Follows one JSON object from its `{` at text[start] token by token, giving its canonical text so
    far, so a call's arguments stream while they are written. Like CallReader it does not
    check the grammar: `closed_object` parses the closed object and only then trusts it."""

    def __init__(self, start: int):
        self.start = start
        self.end: int | None = None  # index after the closing brace, once read
        self._pos = start
        self._depth = 0
        self._canonical = ""
        self._string_pos: int | None = None  # where to go on reading a string

    def read(self, text: str) -> str:
        """Reads what text has added; returns the canonical text so far, which only grows.
        Raises ValueError where text cannot be JSON."""
        while self.end is None:
            if self._string_pos is not None:
                self._string_pos, canonical, is_closed = read_string(text, self._string_pos)
                self._canonical += canonical
                if not is_closed:
                    break
                self._pos, self._string_pos = self._string_pos, None
                continue
            pos = skip_whitespace(text, self._pos)
            if pos == len(text):
                break
            if text[pos] == '"':
                self._canonical += '"'
                self._string_pos = pos + 1
                continue
            token = scan_token(text, pos)
            if token is None:
                break
            self._pos = token.end
            self._canonical += token.text
            self._depth += _DEPTH_CHANGE.get(token.kind, 0)
            if self._depth == 0:
                self.end = self._pos
        return self._canonical

    def closed_object(self, text: str) -> str:
        """The canonical text of the closed object; ValueError if it is not JSON."""
        return dumps(loads(text[self.start : self.end]))


class _ListState(Enum):
    OPEN = "open"  # after `[` or a `,`: a call object next
    CALL = "call"  # in a call object
    AFTER = "after"  # after a call object: `,` or `]`


class JsonCallListParser(ToolParser):
    """A format whose calls are a JSON list of call objects; `_read_list` reads it from the
    `[` at `_pos`. An empty list or a list item that is not a call is malformed."""

    require_arguments = True

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._list_state: _ListState | None = None  # None: the `[` is next

    def _read_list(self, is_final: bool) -> bool:
        """Reads the list as far as the text goes; True once its `]` is handled."""
        text = self._text
        while True:
            pos = skip_whitespace(text, self._pos)
            if pos == len(text) and self._list_state is not _ListState.CALL:
                if is_final:
                    raise ValueError("the output ends inside a list of tool calls")
                return False
            if self._list_state is None:
                self._hold(pos + 1)  # the `[`, checked by the caller
                self._list_state = _ListState.OPEN
            elif self._list_state is _ListState.OPEN:
                if text[pos] != "{":
                    raise ValueError("a list of tool calls holds JSON objects")
                self._start_call(pos)
                self._list_state = _ListState.CALL
            elif self._list_state is _ListState.CALL:
                if not self._read_call_to_its_end(is_final):
                    return False
                self._list_state = _ListState.AFTER
            elif text[pos] == ",":
                self._hold(pos + 1)
                self._list_state = _ListState.OPEN
            elif text[pos] == "]":
                self._drop(pos + 1)
                self._list_state = None
                return True
            else:
                raise ValueError("a list of tool calls needs `,` or `]` after a call")
