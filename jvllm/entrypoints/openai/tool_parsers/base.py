"""The tool call parser interface (vLLM's `ToolParser`): a model's text to OpenAI tool calls,
for a whole response or streamed as chat-completion-chunk deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from jvllm.entrypoints.openai.tool_parsers.call_reader import CallReader, call_fields


def new_call_id() -> str:
    """A tool call's id, OpenAI's form: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    # OpenAI's {"id": "call_<hex>", "type": "function", "function": {"name", "arguments"}},
    # with arguments a JSON string.
    tool_calls: list[dict]
    content: str | None  # the text outside the calls; None when blank


class ToolParser:
    """One parser follows one streamed choice: pass `extract_tool_calls_streaming` the text so
    far after each step, then call `finish` once. Reassembled as an OpenAI client does (content
    concatenated, each call's arguments concatenated by index), its deltas give what
    `extract_tool_calls` gives for the final text, which runs the same machine over that text in
    one step. The exception: a call found malformed after its name went out cannot be taken
    back, so the stream sends the rest as content, where the whole-response parse returns the
    whole output as content (vLLM's rule).

    A format subclass writes its grammar in `_advance`; everything the stream sends goes through
    the helpers below it.
    """

    require_arguments = False  # whether a call object without an arguments key is malformed
    # Whether the format's markers are special tokens, which the reply's text must keep.
    reads_special_tokens = False

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        self.tokenizer = tokenizer  # vLLM's parsers take it; the JSON formats need only text
        # The request's functions, name -> parameters schema: vLLM passes the request to its
        # parsers, and a format whose values are untyped text (qwen3_coder) types them by it.
        self.tools = tools or {}
        self._text = ""
        self._pos = 0  # text[:pos] is handled
        self._held_from = 0  # text[held_from:pos] is held back, as part of a call so far
        self._is_plain = False  # the rest of the text is content
        self._is_malformed = False
        self._reader: CallReader | None = None  # the call being read
        self._num_calls = 0  # calls completely sent
        self._call_id: str | None = None  # the current call's, once its name went out
        self._arguments_sent = ""  # the current call's arguments sent so far
        self._has_content = False  # non-blank content went out
        self._blank_content = ""  # blank content, held until something non-blank follows
        self._delta_content: list[str] = []
        self._delta_calls: dict[int, dict] = {}  # the delta's tool call entries, by index

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The calls in a whole response; any malformed call makes all of it content. Leaves
        this parser's stream as it is."""
        stream = type(self)(self.tokenizer, self.tools)
        deltas = [stream.extract_tool_calls_streaming("", model_output, model_output)]
        deltas.append(stream.finish())
        if stream._is_malformed:
            return ExtractedToolCalls(False, [], model_output if model_output.strip() else None)
        content, tool_calls = _reassemble([delta for delta in deltas if delta is not None])
        return ExtractedToolCalls(bool(tool_calls), tool_calls, content or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str
    ) -> dict | None:
        """The chunk delta for the output grown to `current_text`: {"content": str} and/or
        {"tool_calls": [entry]}, an entry {"index", "id", "type", "function": {"name",
        "arguments"}} when a call's name is first sent, else {"index", "function":
        {"arguments"}}; None while nothing is certain yet. vLLM's signature: the parser keeps
        its own place in current_text, so previous_text and delta_text are not needed."""
        self._text = current_text
        return self._step(is_final=False)

    def finish(self) -> dict | None:
        """The last delta, once the output is complete: held text that could have begun a call
        is content after all, and a call cut off mid-way is malformed."""
        return self._step(is_final=True)

    def _step(self, is_final: bool) -> dict | None:
        if not self._is_plain:
            try:
                self._advance(is_final)
            except ValueError:
                self._is_malformed = self._is_plain = True
                self._pos = self._held_from
        if self._is_plain:
            self._emit_content(len(self._text))
        delta = {}
        if self._delta_content:
            delta["content"] = "".join(self._delta_content)
        if self._delta_calls:
            delta["tool_calls"] = list(self._delta_calls.values())
        self._delta_content, self._delta_calls = [], {}
        return delta or None

    def _advance(self, is_final: bool) -> None:
        """Moves `_pos` through `_text` with the helpers below, as far as is certain, and all
        the way when `is_final`. Raises ValueError where the text breaks the format."""
        raise NotImplementedError

    def _emit_content(self, end: int) -> None:
        """Sends text[pos:end] as content."""
        text = self._text[self._pos : end]
        self._pos = self._held_from = end
        self._send_content(text)

    def _send_content(self, text: str) -> None:
        """Sends `text` as content; a format may send text that is not in the output (the
        newline that joins harmony's messages)."""
        if not self._has_content:  # blank content is None in a whole response, so hold it
            self._blank_content += text
            if not self._blank_content.strip():
                return
            text, self._blank_content, self._has_content = self._blank_content, "", True
        if text:
            self._delta_content.append(text)

    def _content_until(self, marker: str, is_final: bool) -> bool:
        """Sends the content before the next `marker` and moves past the marker (held, as a
        call's markup); False while the marker has not come, with an end of the text that may
        begin it held back until the next text tells."""
        start = self._text.find(marker, self._pos)
        if start < 0:
            held = 0 if is_final else partial_marker_len(self._text, self._pos, marker)
            self._emit_content(len(self._text) - held)
            return False
        self._emit_content(start)
        self._hold(start + len(marker))
        return True

    def _hold(self, end: int) -> None:
        """Moves past text[pos:end], a call's markup, sent as content only if the call fails."""
        self._pos = end

    def _drop(self, end: int) -> None:
        """Moves past text[pos:end], markup of a call already sent."""
        self._pos = self._held_from = end

    def _expect(
        self, pos: int, markers: tuple[str, ...], is_final: bool, may_end: bool = False
    ) -> str | None:
        """The marker among `markers` at text[pos]; None while the text may still become one
        (or, with `may_end`, the output may end there: the marker is the empty string then).
        Raises ValueError where none can follow."""
        text = self._text
        for marker in markers:
            if text.startswith(marker, pos):
                return marker
        if is_final:
            if may_end and pos == len(text):
                return ""
        elif any(marker.startswith(text[pos:]) for marker in markers):
            return None
        raise ValueError(f"a tool call block needs one of {markers} at {pos}")

    def _start_call(self, start: int) -> None:
        """A call object opens at text[start]."""
        self._pos = start
        self._reader = CallReader(start)

    def _read_call_to_its_end(self, is_final: bool) -> bool:
        """`_read_call`, and a call still open when the output is complete is malformed."""
        if self._read_call():
            return True
        if is_final:
            raise ValueError("the output ends inside a tool call's JSON")
        return False

    def _read_call(self) -> bool:
        """Sends what the current call's text shows now; True once it closed, text through its
        closing brace then handled. The name goes out once the arguments have begun (or the
        object closed), so a JSON object that is not a call rarely gets that far."""
        reader = self._reader
        arguments = reader.read(self._text)
        name = reader.name
        if reader.end is not None:
            call_text = self._text[reader.start : reader.end]
            name, arguments = call_fields(call_text, self.require_arguments)
            if not arguments.startswith(self._arguments_sent):  # by construction it does
                raise ValueError("streamed arguments disagree with the parsed call")
        if self._call_id is None and (name is None or not (reader.has_arguments or reader.end)):
            return False
        self._send_call(name, arguments, reader.end)
        return reader.end is not None

    def _new_call_id(self) -> str:
        """A call's id; a format whose models check ids (Mistral's) makes its own."""
        return new_call_id()

    def _send_call(self, name: str, arguments: str, end: int | None) -> None:
        """Sends the current call's name, the first time, and its arguments grown to the
        canonical `arguments`; with `end`, the call is complete and text[:end] handled."""
        index = self._num_calls
        if self._call_id is None:
            self._call_id = self._new_call_id()
            self._delta_calls[index] = {
                "index": index,
                "id": self._call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        if len(arguments) > len(self._arguments_sent):
            entry = self._delta_calls.setdefault(
                index, {"index": index, "function": {"arguments": ""}}
            )
            entry["function"]["arguments"] += arguments[len(self._arguments_sent) :]
            self._arguments_sent = arguments
        if end is None:
            return
        self._drop(end)
        self._reader, self._call_id, self._arguments_sent = None, None, ""
        self._num_calls += 1


def _reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Content and tool calls from deltas, as an OpenAI client accumulates a stream."""
    content = "".join(delta.get("content", "") for delta in deltas)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(
                entry["index"],
                {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
            )
            if "id" in entry:
                call["id"], call["function"]["name"] = entry["id"], entry["function"]["name"]
            call["function"]["arguments"] += entry["function"]["arguments"]
    return content, [calls[index] for index in sorted(calls)]


def partial_marker_len(text: str, pos: int, marker: str) -> int:
    """Length of the longest end of text[pos:] that begins `marker`, held back as content
    until the next text tells whether the marker follows."""
    for length in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
