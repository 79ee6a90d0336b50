"""gpt-oss's reasoning (vLLM's `--reasoning-parser openai_gptoss`): a harmony reply (harmony.py)
split into its reasoning, the analysis channel's messages, and its content, the final
channel's and the commentary channel's preambles (messages without a recipient); each side's
messages are joined by newlines, as vLLM's `parse_chat_output` joins them.

A tool call message goes into the content as the model wrote it, its header opening with
`<|start|>assistant`, so that the tool call parser ("openai", tool_parsers/gpt_oss.py) reads
the calls out of the content as it reads the other formats'. Messages to built-in tools are
dropped.
"""

from __future__ import annotations

from jvllm.entrypoints.openai.harmony import (
    BODY,
    CALL,
    CONTENT,
    END,
    HEADER,
    REASONING,
    START,
    TEXT,
    HarmonyReader,
    Header,
    Segment,
)

# A tool call's header as it opens when the prompt wrote its <|start|>assistant.
_CALL_START = START + "assistant"


class HarmonySplitter:
    """One reply's text in deltas -> (reasoning delta, content delta) pairs; the interface of
    reasoning.ReasoningSplitter."""

    def __init__(self, prompt_opened: bool, constrained: bool = False):
        """prompt_opened: the prompt ends inside an analysis message's body. constrained: the
        reply is under an output constraint from its first token, so it holds headers only
        where it writes them itself (reasoning.py)."""
        if constrained:
            self._reader = HarmonyReader(TEXT)
        elif prompt_opened:
            self._reader = HarmonyReader(BODY, Header("analysis", None, None))
        else:
            self._reader = HarmonyReader(HEADER)
        self._text = ""
        self._num_messages = {REASONING: 0, CONTENT: 0}
        self._owes_newline = False  # the current message follows one of its side's
        if prompt_opened and not constrained:
            self._num_messages[REASONING] = 1

    def feed(self, text: str) -> tuple[str, str]:
        self._text += text
        return self._split(is_final=False)

    def feed_delta(self, text: str, is_last: bool) -> tuple[str, str]:
        """A streamed reply's new text, and what was held back too where it is the last."""
        self._text += text
        return self._split(is_final=is_last)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the reply's end."""
        return self._split(is_final=True)

    def _split(self, is_final: bool) -> tuple[str, str]:
        pieces = {REASONING: [], CONTENT: []}
        for segment in self._reader.read(self._text, is_final):
            text = self._text[segment.start : segment.end]
            if segment.kind == TEXT:
                pieces[CONTENT].append(text)
                continue
            kind = segment.header.kind
            if kind == CALL:
                pieces[CONTENT].append(_call_text(segment, text))
            elif kind in pieces:
                pieces[kind].append(self._message_text(segment, kind, text))
        return "".join(pieces[REASONING]), "".join(pieces[CONTENT])

    def _message_text(self, segment: Segment, kind: str, text: str) -> str:
        """What a segment of a reasoning or content message adds to its side: the body, after
        the newline that joins it to the side's message before, which goes out with the
        message's first text or its end marker (vLLM drops an empty unfinished message)."""
        if segment.kind == HEADER:
            self._owes_newline = self._num_messages[kind] > 0
            self._num_messages[kind] += 1
            return ""
        if segment.kind == END and not text:
            return ""
        newline = "\n" if self._owes_newline else ""
        self._owes_newline = False
        return newline + (text if segment.kind == BODY else "")


def _call_text(segment: Segment, text: str) -> str:
    """A tool call message's segment as it goes into the content: as written, with the
    `<|start|>assistant` that the prompt wrote for the reply's first message."""
    if segment.kind == HEADER and not text.startswith(START):
        return _CALL_START + text
    return text
