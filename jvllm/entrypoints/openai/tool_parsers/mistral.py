"""Mistral tool calls (vLLM's "mistral" parser): content, then `[TOOL_CALLS]` and the calls in
one of two forms. Mistral 7B v0.3, Mixtral and Mistral-Nemo (tokenizers before v11) write a
JSON list, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; Mistral Small 3.2, Devstral
and later (v11+) write each call as `[TOOL_CALLS]name[ARGS]{...}`, and `[ARGS]` is a control
token that decoding may drop, leaving `[TOOL_CALLS]name{...}`."""

from __future__ import annotations

import re
import secrets
import string
from enum import Enum

from jvllm.entrypoints.openai.tool_parsers.json_calls import JsonCallListParser, ValueReader
from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_-]+")  # the v11 form's function name, as vLLM reads it
_ID_CHARS = string.ascii_letters + string.digits
_ID_LENGTH = 9  # mistral-common refuses a tool call id that is not 9 letters and digits


class _State(Enum):
    CONTENT = "content"  # text outside the calls
    OPEN = "open"  # after [TOOL_CALLS]: a JSON list or a name next
    LIST = "list"  # in the JSON list
    NAME = "name"  # in a v11 call's name
    ARGUMENTS = "arguments"  # in a v11 call's arguments object


class MistralToolParser(JsonCallListParser):
    """Content is all text outside the calls, before or after them. A call's id is 9 letters
    and digits (vLLM's `MistralToolCall`), since Mistral's chat templates refuse other ids
    when the calls come back in the conversation."""

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._state = _State.CONTENT
        self._name_start = 0
        self._name = ""
        self._arguments: ValueReader | None = None

    def _new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(_ID_LENGTH))

    def _advance(self, is_final: bool) -> None:
        text = self._text
        while True:
            if self._state is _State.CONTENT:
                if not self._content_until(TOOL_CALLS, is_final):
                    return
                self._state = _State.OPEN
            elif self._state is _State.OPEN:
                pos = skip_whitespace(text, self._pos)
                if pos == len(text):
                    if is_final:
                        raise ValueError(f"nothing after {TOOL_CALLS}")
                    return
                if text[pos] == "[":
                    self._state = _State.LIST
                elif _NAME.match(text, pos):
                    self._hold(pos)
                    self._name_start, self._state = pos, _State.NAME
                else:
                    raise ValueError(f"{TOOL_CALLS} is followed by neither a list nor a name")
            elif self._state is _State.LIST:
                if not self._read_list(is_final):
                    return
                self._state = _State.CONTENT
            elif self._state is _State.NAME:
                if not self._read_name(is_final):
                    return
                self._state = _State.ARGUMENTS
            else:
                if not self._read_arguments(is_final):
                    return
                self._state = _State.CONTENT

    def _read_name(self, is_final: bool) -> bool:
        """Reads `name[ARGS]` or `name` up to the arguments' `{`; True once it is there."""
        text = self._text
        name_end = pos = _NAME.match(text, self._name_start).end()
        args_tag = text[pos : pos + len(ARGS)]
        if args_tag == ARGS:
            pos += len(ARGS)
        if pos == len(text) or (pos + len(args_tag) == len(text) and ARGS.startswith(args_tag)):
            if is_final:
                raise ValueError("the output ends before a tool call's arguments")
            return False  # the name, the [ARGS] or the `{` may come next
        if text[pos] != "{":
            raise ValueError("a tool call's name is not followed by a JSON object")
        self._name = text[self._name_start : name_end]
        self._hold(pos)
        self._arguments = ValueReader(pos)
        return True

    def _read_arguments(self, is_final: bool) -> bool:
        reader = self._arguments
        arguments = reader.read(self._text)
        if reader.end is not None:
            arguments = reader.closed_object(self._text)
            if not arguments.startswith(self._arguments_sent):  # by construction it does
                raise ValueError("streamed arguments disagree with the parsed call")
        elif is_final:
            raise ValueError("the output ends inside a tool call's arguments")
        self._send_call(self._name, arguments, reader.end)
        return reader.end is not None
