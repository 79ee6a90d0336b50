"""Reasoning parsers (vLLM's --reasoning-parser): a thinking model's reply is split into its
reasoning, between `<think>` and `</think>`, and its content, after them. The chat response
carries the reasoning in `reasoning_content` (and `reasoning`, vLLM's newer name), beside
`content`; tool calls are read from the content alone.

A reply thinks when its prompt ends with the start tag (templates that open the thought for the
model, e.g. DeepSeek-R1's and Qwen3-Thinking-2507's), when it starts with the tag itself, or,
for "deepseek_r1", always (R1 always thinks; an unclosed thought is all reasoning). Otherwise
(Qwen3 with thinking switched off) the reply is all content. Streamed or whole, a reply splits
the same way: `ReasoningSplitter` reads the text as it comes and holds back only what could
still be the start of a tag.

Under an output constraint (a JSON schema, a regex, a forced tool call) the grammar holds from
the first token, so a reply thinks only where it opens the thought itself: a constrained JSON
reply to a thinking model is content, not an unclosed thought.

gpt-oss does not think in tags: "openai_gptoss" splits its harmony channels instead
(harmony_reasoning.py), through the same splitter interface (`ReasoningParser.splitter`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jvllm.entrypoints.openai.harmony_reasoning import HarmonySplitter


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    start: str = "<think>"
    end: str = "</think>"
    thinks_by_default: bool = False  # whether a reply with no start tag anywhere thinks
    # Whether the format's markers are special tokens, which the reply's text must keep.
    reads_special_tokens: ClassVar[bool] = False

    def splitter(self, prompt_opened: bool, constrained: bool = False) -> ReasoningSplitter:
        """The splitter of one reply (see ReasoningSplitter)."""
        return ReasoningSplitter(self, prompt_opened, constrained)


@dataclasses.dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony channels (harmony_reasoning.py); `start` opens an analysis message,
    for `prompt_opens_thought`."""

    start: str = "<|channel|>analysis<|message|>"
    end: str = "<|end|>"
    reads_special_tokens: ClassVar[bool] = True

    def splitter(self, prompt_opened: bool, constrained: bool = False) -> HarmonySplitter:
        return HarmonySplitter(prompt_opened, constrained)


@dataclasses.dataclass(frozen=True)
class SpecialTagsReasoningParser(ReasoningParser):
    """`<think>` tags that may be special tokens of the model's tokenizer (GLM-4.5's), kept in
    the reply's text for the split, as vLLM's "glm45" parser reads them."""

    reads_special_tokens: ClassVar[bool] = True


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser(thinks_by_default=True),
    "qwen3": ReasoningParser(),
    "glm45": SpecialTagsReasoningParser(),  # GLM-4.5 / 4.6: Qwen3's tags and rules
    "openai_gptoss": HarmonyReasoningParser(),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}"
        )
    return REASONING_PARSERS[name]


def prompt_opens_thought(parser: ReasoningParser, prompt_tail: str) -> bool:
    """Whether the prompt (its last few tokens' text) ends inside an opened thought."""
    return prompt_tail.rstrip().endswith(parser.start)


class ReasoningSplitter:
    """One reply's text in deltas -> (reasoning delta, content delta) pairs."""

    def __init__(self, parser: ReasoningParser, prompt_opened: bool, constrained: bool = False):
        """constrained: the reply is under an output constraint (see the module's docstring)."""
        self.parser = parser
        self.thinks_by_default = parser.thinks_by_default and not constrained
        # "start": the reply's first characters may still be the start tag; "thought": inside
        # the reasoning; "content": after it (or a reply that does not think).
        self.state = "thought" if prompt_opened and not constrained else "start"
        self.pending = ""  # text held back: it may be the beginning of a tag

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = "", ""
        if self.state == "start":
            start = self.parser.start
            if start.startswith(self.pending.lstrip()) and len(self.pending.lstrip()) < len(start):
                return "", ""  # could still be the start tag
            if self.pending.lstrip().startswith(start):
                self.pending = self.pending.lstrip()[len(start) :]
                self.state = "thought"
            else:
                self.state = "thought" if self.thinks_by_default else "content"
        if self.state == "thought":
            end = self.parser.end
            index = self.pending.find(end)
            if index < 0:
                cut = len(self.pending) - _held_back(self.pending, end)
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:index], self.pending[index + len(end) :]
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content

    def feed_delta(self, text: str, is_last: bool) -> tuple[str, str]:
        """A streamed reply's new text, and what was held back too where it is the last."""
        reasoning, content = self.feed(text)
        if is_last:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the reply's end: an unclosed thought's tail is reasoning."""
        held, self.pending = self.pending, ""
        if self.state == "thought" or (self.state == "start" and self.thinks_by_default):
            return held, ""
        return "", held


def split_reply(
    parser: ReasoningParser, text: str, prompt_opened: bool, constrained: bool = False
) -> tuple[str, str]:
    """A whole reply -> (reasoning, content)."""
    splitter = parser.splitter(prompt_opened, constrained)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return reasoning + more_reasoning, content + more_content


def add_reasoning(message: dict, reasoning: str | None, include: bool) -> None:
    """A reply's reasoning into a chat message or delta under vLLM's two names
    (`reasoning_content`, and `reasoning`, which newer vLLM writes), or None where the request
    asked for none (include_reasoning=false)."""
    value = reasoning if include else None
    message["reasoning_content"] = value
    message["reasoning"] = value


def _held_back(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may finish in the next
    delta)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
