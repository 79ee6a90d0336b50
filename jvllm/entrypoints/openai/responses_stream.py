"""One streamed reply as the Responses API's output item events: an item is added when its first
text comes, its text or arguments go out as deltas, and it is done when the reply ends or moves
on. The reasoning parser splits reasoning from the text, and the tool call stream (tool_calls.py,
chat's) splits the text into message content and function calls, so calls stream as they are
parsed, "auto" ones included.

The reply's items are the whole reply's (serving_responses.py): reasoning, one message holding
all the content, then the calls. So the message, once added, stays open until the reply ends:
a parser sends the text between and after calls (a newline between two hermes calls) as
content, which joins the message's text, as in the whole reply."""

from __future__ import annotations

from collections.abc import Callable

from jvllm.entrypoints.openai.reasoning import ReasoningSplitter
from jvllm.entrypoints.openai.responses_items import (
    Events,
    call_item,
    message_item,
    reasoning_item,
    text_part,
)
from jvllm.entrypoints.openai.tool_calls import ToolCallStream
from jvllm.outputs import CompletionOutput


class ResponseStream:
    def __init__(
        self,
        events: Events,
        splitter: ReasoningSplitter | None,
        calls: ToolCallStream | None,
        logprobs: Callable[[CompletionOutput], list[dict]] | None,
    ):
        """`splitter`: the reasoning parser's, None without one; `calls`: the tool calls',
        None without tools; `logprobs`: a step's logprobs.content entries, None unless asked."""
        self.events = events
        self.splitter = splitter
        self.calls = calls
        self.logprobs = logprobs
        self.output: list[dict] = []  # the items so far, in output_index order
        self._message: int | None = None  # the message's index, once added
        self._open: int | None = None  # the index of the reasoning or call item streaming
        # Logprobs of the tokens whose text has not gone out in the message yet (reasoning,
        # text the parser holds back, calls): they go with the message's next delta, as vLLM
        # puts all of a reply's logprobs on its message.
        self._pending: list[dict] = []

    @property
    def reasoning(self) -> str:
        """The reasoning streamed, for usage's reasoning_tokens."""
        return "".join(
            item["content"][0]["text"] for item in self.output if item["type"] == "reasoning"
        )

    def feed(self, completion: CompletionOutput) -> list[str]:
        """The events of one engine step's new tokens."""
        is_last = bool(completion.finish_reason)
        if self.logprobs is not None:
            self._pending += self.logprobs(completion)
        reasoning, text = "", completion.text
        if self.splitter is not None:
            reasoning, text = self.splitter.feed_delta(text, is_last)
        lines = self._reasoning(reasoning) if reasoning else []
        if self.calls is None:
            return lines + (self._text(text) if text else [])
        lines += self._apply(self.calls.feed(text))
        if is_last:  # what the parser held back
            lines += self._apply(self.calls.finish())
        return lines

    def finish(self) -> list[str]:
        """The last events: an empty reply is still a message, logprobs still pending go with
        the message, and the items still open are done."""
        lines = self._close(self._open)
        if self._message is None and not any(i["type"] == "function_call" for i in self.output):
            lines += self._add_message()
        if self._pending and self._message is not None:
            lines += self._text("")
        return lines + self._close(self._message)

    def _apply(self, delta: dict | None) -> list[str]:
        """The events of a tool call stream's chunk delta: its content, then its calls."""
        if not delta:
            return []
        lines = self._text(delta["content"]) if delta.get("content") else []
        for entry in delta.get("tool_calls", []):
            function = entry["function"]
            if "id" in entry:
                item = call_item(entry["id"], function["name"], "", "in_progress")
                lines += self._close(self._open) + self._add(item)
                self._open = len(self.output) - 1
            if function["arguments"]:
                lines += self._arguments(function["arguments"])
        return lines

    def _add(self, item: dict) -> list[str]:
        """`item` added to the output, as it stands."""
        self.output.append(item)
        index = len(self.output) - 1
        return [self.events.emit("response.output_item.added", output_index=index, item=item)]

    def _add_message(self) -> list[str]:
        """The message added, with its output_text part."""
        lines = self._add(message_item(None, "in_progress"))
        self._message = len(self.output) - 1
        self.output[-1]["content"] = [text_part("", [])]
        at = self._at(self._message, content_index=0)
        part = text_part("", [])
        return [*lines, self.events.emit("response.content_part.added", **at, part=part)]

    def _at(self, index: int, **more) -> dict:
        """The place of item `index`, as its events give it."""
        return {"item_id": self.output[index]["id"], "output_index": index, **more}

    def _reasoning(self, delta: str) -> list[str]:
        lines = []
        if self._open is None or self.output[self._open]["type"] != "reasoning":
            lines += self._close(self._open) + self._add(reasoning_item(None, "in_progress"))
            self._open = len(self.output) - 1
            self.output[-1]["content"] = [{"type": "reasoning_text", "text": ""}]
        self.output[self._open]["content"][0]["text"] += delta
        at = self._at(self._open, content_index=0)
        return [*lines, self.events.emit("response.reasoning_text.delta", **at, delta=delta)]

    def _text(self, delta: str) -> list[str]:
        """`delta` of the message's text: the reasoning or call before it is done."""
        lines = self._close(self._open)
        if self._message is None:
            lines += self._add_message()
        part = self.output[self._message]["content"][0]
        logprobs, self._pending = self._pending, []
        part["text"] += delta
        part["logprobs"] += logprobs
        at = self._at(self._message, content_index=0)
        event = self.events.emit("response.output_text.delta", **at, delta=delta, logprobs=logprobs)
        return [*lines, event]

    def _arguments(self, delta: str) -> list[str]:
        self.output[self._open]["arguments"] += delta
        at = self._at(self._open)
        return [self.events.emit("response.function_call_arguments.delta", **at, delta=delta)]

    def _close(self, index: int | None) -> list[str]:
        """The closing events of item `index` (None: none)."""
        if index is None:
            return []
        if index == self._open:
            self._open = None
        item = self.output[index]
        item["status"] = "completed"
        if item["type"] == "message":
            part, at = item["content"][0], self._at(index, content_index=0)
            lines = [
                self.events.emit(
                    "response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"]
                ),
                self.events.emit("response.content_part.done", **at, part=part),
            ]
        elif item["type"] == "reasoning":
            text, at = item["content"][0]["text"], self._at(index, content_index=0)
            lines = [self.events.emit("response.reasoning_text.done", **at, text=text)]
        else:
            done = {"name": item["name"], "arguments": item["arguments"]}
            lines = [
                self.events.emit("response.function_call_arguments.done", **self._at(index), **done)
            ]
        lines.append(self.events.emit("response.output_item.done", output_index=index, item=item))
        return lines
