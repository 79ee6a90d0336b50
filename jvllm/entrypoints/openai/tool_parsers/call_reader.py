"""One `{"name": ..., "arguments": {...}}` tool call object, read from a growing text."""

from __future__ import annotations

from jvllm.entrypoints.openai.tool_parsers.partial_json import (
    Pairs,
    Token,
    dumps,
    loads,
    read_string,
    scan_token,
    skip_whitespace,
)

# The key of a call's arguments: Hermes and OpenAI write "arguments", Llama 3 "parameters".
ARGUMENT_KEYS = ("arguments", "parameters")
_DEPTH_CHANGE = {"{": 1, "[": 1, "}": -1, "]": -1}


def call_fields(text: str, require_arguments: bool) -> tuple[str, str]:
    """(name, canonical arguments) of a closed call object's text. Without an arguments key
    they are "{}" unless `require_arguments`. Raises ValueError if text is not such a call."""
    call = loads(text)
    if not isinstance(call, Pairs):
        raise ValueError("a tool call must be a JSON object")  # noqa: TRY004 - malformed output
    names = [value for key, value in call if key == "name"]
    if not names or not isinstance(names[0], str):
        raise ValueError('a tool call needs a string "name"')
    arguments = [value for key, value in call if key in ARGUMENT_KEYS]
    if not arguments and require_arguments:
        raise ValueError(f"a tool call needs one of {ARGUMENT_KEYS}")
    return names[0], dumps(arguments[0]) if arguments else "{}"


class CallReader:
    """Follows the call object's top-level keys token by token, so the name is known as soon
    as its string closes and the arguments can be sent while they are still being written.

    It does not check the object's grammar: the caller parses the closed object with json.loads
    and only then trusts it. The first "name" and the first arguments key count, as in
    `call_fields`.
    """

    def __init__(self, start: int):
        self.start = start  # index of the opening brace
        self.end: int | None = None  # index after the closing brace, once read
        self.name: str | None = None
        self.has_arguments = False  # an arguments key has been read
        self._pos = start
        self._depth = 0
        self._key: str | None = None  # the last top-level key read
        self._value_key: str | None = None  # the key whose value comes next
        self._is_key_next = False
        self._is_name_read = False
        self._is_in_arguments = False
        self._arguments = ""  # canonical text of the arguments read so far
        self._string_pos: int | None = None  # where to go on reading an arguments string

    def read(self, text: str) -> str:
        """Reads what text has added; returns the canonical arguments text so far, which only
        grows. Raises ValueError where text cannot be JSON."""
        while self.end is None:
            if self._string_pos is not None:  # in a string of the arguments
                self._string_pos, canonical, is_closed = read_string(text, self._string_pos)
                self._arguments += canonical
                if not is_closed:
                    break
                self._pos, self._string_pos = self._string_pos, None
                self._is_in_arguments = self._depth > 1
                continue
            pos = skip_whitespace(text, self._pos)
            if pos == len(text):
                break
            if self._is_in_arguments and text[pos] == '"':
                self._arguments += '"'
                self._string_pos = pos + 1
                continue
            token = scan_token(text, pos)
            if token is None:
                break
            self._pos = token.end
            self._take(token)
        return self._arguments

    def _take(self, token: Token) -> None:
        depth = self._depth
        self._depth += _DEPTH_CHANGE.get(token.kind, 0)
        if self._is_in_arguments:
            self._arguments += token.text
            self._is_in_arguments = self._depth > 1  # back at depth 1: the value is complete
        elif depth == 0:  # the opening brace
            self._is_key_next = True
        elif self._depth == 0:
            self.end = token.end
        elif depth == 1:
            self._take_member(token)

    def _take_member(self, token: Token) -> None:
        """A token of the call object itself (depth 1): a key, a colon, a comma or a value."""
        if token.kind == ",":
            self._is_key_next = True
        elif token.kind == ":":
            self._value_key = self._key
            if self._key in ARGUMENT_KEYS and not self.has_arguments:
                self.has_arguments = True
                self._is_in_arguments = True
        elif self._is_key_next and token.kind == "string":
            self._key = token.value
            self._is_key_next = False
        else:
            if self._value_key == "name" and not self._is_name_read:
                self._is_name_read = True
                if token.kind == "string":
                    self.name = token.value
            self._value_key = None
