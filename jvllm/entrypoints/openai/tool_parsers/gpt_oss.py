"""gpt-oss tool calls (vLLM's "openai" parser): harmony messages (harmony.py) to a function,
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`
and `<|call|>`, whose body is the call's arguments.

The parser reads a whole harmony reply, or the content that the "openai_gptoss" reasoning
parser leaves (text, with the calls as written). Content is the text outside messages and the
final channel's and the preambles' bodies (commentary without a recipient), joined by newlines
as vLLM's `parse_chat_output` joins them; analysis messages and messages to built-in tools are
dropped. vLLM's whole-reply parser returns only the last final message (or preamble) instead;
a stream cannot take back what it sent, so here the whole reply gives what the stream gives.
"""

from __future__ import annotations

from jvllm.entrypoints.openai.harmony import (
    BODY,
    CALL,
    CONTENT,
    END,
    HEADER,
    TEXT,
    HarmonyReader,
    Segment,
)
from jvllm.entrypoints.openai.tool_parsers.base import ToolParser
from jvllm.entrypoints.openai.tool_parsers.json_calls import ValueReader
from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace


class OpenAIToolParser(ToolParser):
    """A call's name goes out with its header, its arguments as its JSON body is read, in the
    canonical form of the other formats (vLLM re-serialises them too); a body that is not one
    JSON object is malformed, the base class's rule (vLLM keeps its text as the arguments). A
    content type other than JSON keeps the body's text as the arguments, as vLLM does."""

    reads_special_tokens = True

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._harmony = HarmonyReader(TEXT)
        self._name = ""
        self._is_json = True  # the current call's body is JSON
        self._body_start = 0
        self._arguments: ValueReader | None = None
        self._num_content_messages = 0
        self._owes_newline = False  # the current content message follows another

    def _advance(self, is_final: bool) -> None:
        for segment in self._harmony.read(self._text, is_final):
            if segment.kind == TEXT:
                self._emit_content(segment.end)
                continue
            kind = segment.header.kind
            if kind == CALL:
                self._read_call(segment)
            elif kind == CONTENT:
                self._read_content(segment)
            else:
                self._drop(segment.end)

    def _read_content(self, segment: Segment) -> None:
        """A content message's segment: its body goes out, after the newline that joins it to
        the message before (with its first text or its end marker)."""
        if segment.kind == HEADER:
            self._owes_newline = self._num_content_messages > 0
            self._num_content_messages += 1
            self._drop(segment.end)
            return
        if self._owes_newline and (segment.kind == BODY or segment.end > segment.start):
            self._send_content("\n")
            self._owes_newline = False
        if segment.kind == BODY:
            self._emit_content(segment.end)
        else:
            self._drop(segment.end)

    def _read_call(self, segment: Segment) -> None:
        """A call message's segment: the name at its header, the arguments as its body grows,
        and the call complete at its end."""
        if segment.kind == HEADER:
            self._hold(segment.end)
            self._name = segment.header.function
            content_type = segment.header.content_type
            self._is_json = content_type is None or "json" in content_type
            self._body_start, self._arguments = segment.end, None
            self._send_call(self._name, "", None)
            return
        body_end = segment.end if segment.kind == BODY else segment.start
        arguments = self._read_arguments(body_end, is_end=segment.kind == END)
        self._send_call(self._name, arguments, segment.end if segment.kind == END else None)

    def _read_arguments(self, body_end: int, is_end: bool) -> str:
        """The arguments that text[body_start:body_end], the body so far, shows. Raises
        ValueError where a JSON body is not one JSON object."""
        body = self._text[:body_end]
        if not self._is_json:
            return body[self._body_start :]
        if self._arguments is None:
            start = skip_whitespace(body, self._body_start)
            if start == len(body):
                if is_end:
                    raise ValueError("a tool call's body is empty")
                return ""
            if body[start] != "{":
                raise ValueError("a tool call's body is not a JSON object")
            self._arguments = ValueReader(start)
        reader = self._arguments
        arguments = reader.read(body)
        if not is_end:
            return arguments
        if reader.end is None or skip_whitespace(body, reader.end) != len(body):
            raise ValueError("a tool call's body is not one whole JSON object")
        arguments = reader.closed_object(body)
        if not arguments.startswith(self._arguments_sent):  # by construction it does
            raise ValueError("streamed arguments disagree with the parsed call")
        return arguments
