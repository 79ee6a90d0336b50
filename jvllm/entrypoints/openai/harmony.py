"""OpenAI's harmony format, in which gpt-oss writes its replies, read from a growing text.

A reply is a run of messages `<|start|>assistant{header}<|message|>{body}<|end|>`. The prompt
ends with the first message's `<|start|>assistant`, so a reply starts inside a header. A header
names the channel (`<|channel|>analysis`, `commentary` or `final`) and, for a tool call, the
recipient (`to=functions.NAME`, before or after the channel) and content type (`<|constrain|>json`
or `json`). A body ends at `<|end|>`, or at `<|call|>` or `<|return|>`, which are stop tokens:
their text is not output, so a reply that stopped ends inside its last body. The markers are
special tokens, in the text only where the reply keeps them (`skip_special_tokens=False`).

`HarmonyReader` cuts the text into segments as far as they are certain, holding back an end
that may begin a marker; the reasoning parser (harmony_reasoning.py) and the tool call parser
(tool_parsers/gpt_oss.py) map them to reasoning, content and tool calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."
# Where a header may start in text that is not inside a message.
_HEADER_STARTS = (START, CHANNEL)
# The reply's first header may name its recipient before its channel; only a function call's
# is told from content that happens to start with "to=".
_FIRST_RECIPIENT = "to=" + FUNCTIONS
_CHANNEL_NAME = re.compile(r"[^\s<]*")  # a channel's name ends at whitespace or a marker

# What a message is to the chat API (`Header.kind`).
REASONING, CONTENT, CALL, OTHER = "reasoning", "content", "call", "other"
# `Segment.kind`s.
TEXT, HEADER, BODY, END = "text", "header", "body", "end"


@dataclass(frozen=True)
class Header:
    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def function(self) -> str | None:
        """The name of the function a tool call message calls; None for other messages."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :]

    @property
    def kind(self) -> str:
        """vLLM's reading: the analysis channel is reasoning (even to a recipient); a message
        to a function is a call; the final channel and the commentary channel's preambles (no
        recipient) are content; anything else (built-in tools) is dropped."""
        if self.channel == "analysis":
            return REASONING
        if self.function is not None:
            return CALL
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return CONTENT
        return OTHER


def parse_header(text: str) -> Header:
    """A header's text, from its `<|start|>` (absent in the reply's first) to its `<|message|>`,
    read by harmony's rules: the channel is cut out, the role dropped, and of the parts left
    the last is the recipient when it starts with `to=` or stands alone, else the content type,
    with the recipient before it. harmony refuses any further parts; they are ignored here."""
    has_role = text.startswith(START)
    text = text.removeprefix(START)
    channel = None
    index = text.find(CHANNEL)
    if index >= 0:
        name = _CHANNEL_NAME.match(text, index + len(CHANNEL))
        channel = name.group() or None
        text = text[:index] + " " + text[name.end() :]
    parts = text.replace(CONSTRAIN, " " + CONSTRAIN).split()
    if parts and (has_role or parts[0] == "assistant"):
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to="):
            recipient = last.removeprefix("to=")
        elif not parts and not last.startswith(CONSTRAIN):
            recipient = last
        else:
            content_type = last
            recipient = parts.pop().removeprefix("to=") if parts else None
    return Header(channel, recipient, content_type)


@dataclass(frozen=True)
class Segment:
    """text[start:end] is `kind`: TEXT outside any message, a message's HEADER (through its
    `<|message|>`), a piece of its BODY, or its END marker (empty where the output ended)."""

    kind: str
    start: int
    end: int
    header: Header | None = None  # the message's, but for TEXT


class HarmonyReader:
    """A growing text -> its segments, each handed out once, as soon as it is certain."""

    def __init__(self, state: str = TEXT, header: Header | None = None):
        """state: HEADER for a reply as the model wrote it (it starts in its first header);
        BODY with `header` where the prompt opened a message; TEXT where no header need come
        first (a parser's text that may hold only content, a constrained reply)."""
        self._state = state
        self._header = header
        self._pos = 0  # text[:pos] is handed out (or dropped)

    def read(self, text: str, is_final: bool) -> list[Segment]:
        """The segments of what `text` (the whole text so far) adds, and with `is_final` of
        all of it: a header cut off by the output's end is dropped (vLLM's parser keeps no
        message for it), a body cut off is complete."""
        segments: list[Segment] = []
        while True:
            if self._state == TEXT:
                start, end = self._header_start(text, is_final)
                self._add(segments, TEXT, end, None)
                if start is None:
                    return segments
                self._state, self._pos = HEADER, start
            elif self._state == HEADER:
                index = text.find(MESSAGE, self._pos)
                if index < 0:
                    return segments
                self._header = parse_header(text[self._pos : index])
                self._add(segments, HEADER, index + len(MESSAGE), self._header)
                self._state = BODY
            else:
                index, marker = _first(text, self._pos, ENDS)
                if index is None:
                    held = 0 if is_final else _held_len(text, self._pos, ENDS)
                    self._add(segments, BODY, len(text) - held, self._header)
                    if is_final:
                        segments.append(Segment(END, len(text), len(text), self._header))
                        self._state = TEXT
                    return segments
                self._add(segments, BODY, index, self._header)
                segments.append(Segment(END, index, index + len(marker), self._header))
                self._pos, self._state = index + len(marker), TEXT

    def _header_start(self, text: str, is_final: bool) -> tuple[int | None, int]:
        """(where the next header starts, None if none yet; where the text before it, which
        is certain, ends)."""
        if self._pos == 0:
            head = text.lstrip()
            if head.startswith(_FIRST_RECIPIENT):
                return 0, 0
            if _FIRST_RECIPIENT.startswith(head) and not is_final:
                return None, 0
        index, _ = _first(text, self._pos, _HEADER_STARTS)
        if index is not None:
            return index, index
        return None, len(text) - (0 if is_final else _held_len(text, self._pos, _HEADER_STARTS))

    def _add(self, segments: list[Segment], kind: str, end: int, header: Header | None) -> None:
        if end > self._pos:
            segments.append(Segment(kind, self._pos, end, header))
            self._pos = end


def _first(text: str, pos: int, markers: tuple[str, ...]) -> tuple[int | None, str]:
    """The first of `markers` in text[pos:]: (its index, it), or (None, "")."""
    found = [(index, m) for m in markers if (index := text.find(m, pos)) >= 0]
    return min(found) if found else (None, "")


def _held_len(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """The length of the longest end of text[pos:] that begins one of `markers`, held back
    until the next text tells."""
    for length in range(min(max(map(len, markers)) - 1, len(text) - pos), 0, -1):
        if any(m.startswith(text[-length:]) for m in markers):
            return length
    return 0
