"""POST /v1/responses: OpenAI's Responses API over the chat template, as vLLM serves it for
text: `input` (a string, or message items) after `instructions`, one reply, given whole or as
the API's typed stream events. With --reasoning-parser a thinking model's reasoning is an
output item of its own. Responses are not stored (vLLM's default), so `previous_response_id`
and tools are refused (unsupported.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from jvllm.entrypoints.chat import text_content
from jvllm.entrypoints.openai.protocol import OpenAIError, ResponsesRequest
from jvllm.entrypoints.openai.reasoning import ReasoningSplitter, split_reply
from jvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jvllm.entrypoints.openai.serving_engine import OpenAIServing, now, sse
from jvllm.entrypoints.openai.structured import structured_outputs
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import RequestOutputKind

# The item types of `input` that are messages, and the roles the chat template sees for them.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# The fields shared with chat and completions (protocol._SamplingFields) that a response has no
# place for, with the value that leaves them unused.
_CHAT_ONLY_FIELDS = {
    "prompt_logprobs": None,
    "return_token_ids": False,
    "return_tokens_as_token_ids": False,
    "stream_options": None,
}


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        """Renders through `chat` (its template, trust and reasoning parser)."""
        super().__init__(chat.engine, chat.model_names)
        self.chat = chat

    async def create(self, request: ResponsesRequest):
        """A response dict, or an async iterator of SSE lines when streaming."""
        self.check_model(request.model)
        if request.n != 1 or request.use_beam_search:
            raise OpenAIError("/v1/responses gives one reply: n must be 1", param="n")
        for name, unused in _CHAT_ONLY_FIELDS.items():
            if getattr(request, name) != unused:
                raise OpenAIError(
                    f"'{name}' is a chat and completions field; /v1/responses does not take it",
                    param=name,
                )
        self.check_request(request)
        messages = _messages(request)
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "input", request)
        prompt_token_ids = self.chat.render(
            messages, kwargs=request.chat_template_kwargs, chat_template=None
        )
        prompt_token_ids = self.truncated(prompt_token_ids, request)
        max_tokens = self.check_length(
            len(prompt_token_ids), request.max_output_tokens, "max_output_tokens"
        )
        params = self.sampling_params(
            request, max_tokens, None, constraint=structured_outputs(request)
        )
        response_id = f"resp_{request.request_id or uuid.uuid4().hex}"
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        prompt = {
            "prompt": None,
            "prompt_token_ids": prompt_token_ids,
            "cache_salt": request.cache_salt,
        }
        outputs = self.generate_all([prompt], params, response_id, kind, None, request.priority)
        try:
            first = await anext(outputs)  # errors at admission become a 400, not a broken stream
        except StopAsyncIteration:
            first = None
        # How the reply starts, for the reasoning parser: inside a thought, under a constraint.
        start = (self.chat.opens_thought(prompt_token_ids), params.structured_outputs is not None)
        view = _ResponseView(request, response_id, self.model_name, len(prompt_token_ids))
        if request.stream:
            return self._stream(view, first, outputs, start)
        await outputs.aclose()
        result = first[1]
        reasoning, text = self._split(start, result.outputs[0].text)
        return view.response(result, reasoning, text, self._count(reasoning))

    def _split(self, start: tuple[bool, bool], text: str) -> tuple[str | None, str]:
        if self.chat.reasoning_parser is None:
            return None, text
        reasoning, content = split_reply(self.chat.reasoning_parser, text, *start)
        return reasoning or None, content

    def _count(self, reasoning: str | None) -> int:
        """Tokens of the reasoning (usage's reasoning_tokens), re-read from its text."""
        return len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    async def _stream(
        self, view: _ResponseView, first, outputs: AsyncIterator, start: tuple[bool, bool]
    ) -> AsyncIterator[str]:
        events = _Events()
        parser = self.chat.reasoning_parser
        splitter = ReasoningSplitter(parser, *start) if parser is not None else None
        reasoning, text = "", ""
        open_items: list[str] = []  # "reasoning", then "message", as each starts
        try:
            yield events.emit("response.created", response=view.shell("in_progress"))
            yield events.emit("response.in_progress", response=view.shell("in_progress"))
            item, result = first, None
            while item is not None:
                result = item[1]
                c = result.outputs[0]
                new_reasoning, new_text = "", c.text
                if splitter is not None:
                    new_reasoning, new_text = splitter.feed(c.text)
                    if c.finish_reason:
                        more_reasoning, more_text = splitter.finish()
                        new_reasoning += more_reasoning
                        new_text += more_text
                if new_reasoning:
                    if "reasoning" not in open_items:
                        open_items.append("reasoning")
                        for line in view.reasoning_started(events, len(open_items) - 1):
                            yield line
                    reasoning += new_reasoning
                    yield view.reasoning_delta(events, open_items.index("reasoning"), new_reasoning)
                if new_text:
                    if "message" not in open_items:
                        open_items.append("message")
                        for line in view.message_started(events, len(open_items) - 1):
                            yield line
                    text += new_text
                    yield view.text_delta(events, open_items.index("message"), new_text)
                item = await anext(outputs, None)
            if "message" not in open_items:  # an empty reply is still a message
                open_items.append("message")
                for line in view.message_started(events, len(open_items) - 1):
                    yield line
            for index, name in enumerate(open_items):
                done = view.reasoning_done if name == "reasoning" else view.message_done
                for line in done(events, index, reasoning if name == "reasoning" else text):
                    yield line
            final = view.response(result, reasoning or None, text, self._count(reasoning or None))
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield events.emit(kind, response=final)
        except OpenAIError as e:
            yield events.emit("error", message=e.message, code=e.code, param=e.param)
        finally:
            await outputs.aclose()


class _Events:
    """The stream's events, numbered as the API numbers them."""

    def __init__(self):
        self.sequence_number = 0

    def emit(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(body)}"


class _ResponseView:
    """The response object and its items, for one request."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, num_prompt: int):
        self.request = request
        self.id = response_id
        self.model = model
        self.num_prompt = num_prompt
        self.created_at = now()
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"

    def shell(self, status: str, output: list | None = None) -> dict:
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output or [],
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "user": request.user,
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    def response(
        self, result: RequestOutput, reasoning: str | None, text: str, num_reasoning: int
    ) -> dict:
        completion = result.outputs[0]
        output = []
        if reasoning is not None:
            output.append(self._reasoning_item(reasoning, "completed"))
        output.append(self._message_item(text, "completed"))
        incomplete = completion.finish_reason == "length"
        body = self.shell("incomplete" if incomplete else "completed", output)
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        num_output = len(completion.token_ids)
        body["usage"] = {
            "input_tokens": self.num_prompt,
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": self.num_prompt + num_output,
        }
        return body

    def _message_item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [_text_part(text)]
        return {
            "type": "message",
            "id": self.message_id,
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _reasoning_item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def message_started(self, events: _Events, index: int) -> list[str]:
        at = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return [
            events.emit(
                "response.output_item.added",
                output_index=index,
                item=self._message_item(None, "in_progress"),
            ),
            events.emit("response.content_part.added", **at, part=_text_part("")),
        ]

    def text_delta(self, events: _Events, index: int, delta: str) -> str:
        at = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return events.emit("response.output_text.delta", **at, delta=delta, logprobs=[])

    def message_done(self, events: _Events, index: int, text: str) -> list[str]:
        at = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return [
            events.emit("response.output_text.done", **at, text=text, logprobs=[]),
            events.emit("response.content_part.done", **at, part=_text_part(text)),
            events.emit(
                "response.output_item.done",
                output_index=index,
                item=self._message_item(text, "completed"),
            ),
        ]

    def reasoning_started(self, events: _Events, index: int) -> list[str]:
        return [
            events.emit(
                "response.output_item.added",
                output_index=index,
                item=self._reasoning_item(None, "in_progress"),
            )
        ]

    def reasoning_delta(self, events: _Events, index: int, delta: str) -> str:
        at = {"item_id": self.reasoning_id, "output_index": index, "content_index": 0}
        return events.emit("response.reasoning_text.delta", **at, delta=delta)

    def reasoning_done(self, events: _Events, index: int, text: str) -> list[str]:
        at = {"item_id": self.reasoning_id, "output_index": index, "content_index": 0}
        return [
            events.emit("response.reasoning_text.done", **at, text=text),
            events.emit(
                "response.output_item.done",
                output_index=index,
                item=self._reasoning_item(text, "completed"),
            ),
        ]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _messages(request: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages; an item that is not a text message is a 400
    naming it."""
    messages = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        if not request.input:
            raise OpenAIError("input must not be empty", param="input")
        return [*messages, {"role": "user", "content": request.input}]
    if not request.input:
        raise OpenAIError("input must not be empty", param="input")
    for i, item in enumerate(request.input):
        kind, role = item.get("type", "message"), item.get("role")
        if kind != "message" or role not in _ROLES:
            raise OpenAIError(
                f"input[{i}] is a {kind!r} item with role {role!r}; jvllm takes message items "
                f"with a role in {sorted(_ROLES)} (tool calls and outputs are not supported)",
                param="input",
            )
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIError(
                        f"input[{i}].content[{j}] is a {kind!r} part; jvllm takes text parts "
                        f"({', '.join(_TEXT_PARTS)})",
                        param="input",
                    )
                parts.append({"type": "text", "text": part.get("text", "")})
            content = parts
        messages.append({"role": _ROLES[role], "content": content})
    try:
        return text_content(messages)
    except ValueError as e:
        raise OpenAIError(str(e), param="input") from None
