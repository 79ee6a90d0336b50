"""POST /v1/responses: OpenAI's Responses API over the chat template, as vLLM serves it: `input`
(a string, or message and function-call items) after `instructions`, function tools, one reply,
given whole or as the API's typed stream events. With --reasoning-parser a thinking model's
reasoning is an output item of its own; tool calls are function_call items, forced or parsed
out of the text as on /v1/chat/completions. Responses are not stored (vLLM's default), so
`previous_response_id` is refused (unsupported.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from jvllm.entrypoints.openai.protocol import OpenAIError, ResponsesRequest
from jvllm.entrypoints.openai.reasoning import ReasoningSplitter, split_reply
from jvllm.entrypoints.openai.responses_input import chat_messages, chat_tools_request
from jvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jvllm.entrypoints.openai.serving_engine import OpenAIServing, now, sse
from jvllm.entrypoints.openai.structured import structured_outputs
from jvllm.entrypoints.openai.tool_calls import ToolPlan, plan_tools, reply
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import RequestOutputKind

# The fields shared with chat and completions (protocol._SamplingFields) that a response has no
# place for, with the value that leaves them unused.
_CHAT_ONLY_FIELDS = {
    "prompt_logprobs": None,
    "return_token_ids": False,
    "return_tokens_as_token_ids": False,
}


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        """Renders through `chat` (its template, trust, tool and reasoning parsers)."""
        super().__init__(chat.engine, chat.model_names)
        self.chat = chat

    async def create(self, request: ResponsesRequest):
        """A response dict, or an async iterator of SSE lines when streaming."""
        adapter = self.check_model(request.model)
        if request.n != 1 or request.use_beam_search:
            raise OpenAIError("/v1/responses gives one reply: n must be 1", param="n")
        for name, unused in _CHAT_ONLY_FIELDS.items():
            if getattr(request, name) != unused:
                raise OpenAIError(
                    f"'{name}' is a chat and completions field; /v1/responses does not take it",
                    param=name,
                )
        self.check_request(request)
        tools_request = chat_tools_request(request)
        plan = plan_tools(tools_request, self.chat.tool_parser)
        constraint = structured_outputs(request)
        if plan.constraint is not None:
            if constraint is not None:
                raise OpenAIError(
                    f"tool_choice {request.tool_choice!r} already constrains the reply; "
                    "leave out text.format",
                    param="tool_choice",
                )
            constraint = plan.constraint
        messages = chat_messages(request)
        num_chars = sum(len(m["content"] or "") for m in messages)
        self.check_prompt_chars(num_chars, "input", request)
        prompt_token_ids = self.chat.render(
            messages,
            kwargs=request.chat_template_kwargs,
            chat_template=None,
            tools=tools_request.tools,
        )
        prompt_token_ids = self.truncated(prompt_token_ids, request)
        max_tokens = self.check_length(
            len(prompt_token_ids), request.max_output_tokens, "max_output_tokens"
        )
        params = self.sampling_params(request, max_tokens, None, constraint=constraint)
        response_id = f"resp_{request.request_id or uuid.uuid4().hex}"
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        prompt = {
            "prompt": None,
            "prompt_token_ids": prompt_token_ids,
            "cache_salt": request.cache_salt,
        }
        options = (None, request.priority, adapter)
        outputs = self.generate_all([prompt], params, response_id, kind, *options)
        try:
            first = await anext(outputs)  # errors at admission become a 400, not a broken stream
        except StopAsyncIteration:
            first = None
        # How the reply starts, for the reasoning parser: inside a thought, under a constraint.
        start = (self.chat.opens_thought(prompt_token_ids), constraint is not None)
        name = self.models.reply_name(request.model)
        view = _ResponseView(request, response_id, name, len(prompt_token_ids))
        if request.stream and plan.mode == "none":
            return self._stream(view, first, outputs, start)
        if request.stream:  # calls are known once the reply is: its items go out whole
            return self._stream_whole(view, first, outputs, start, plan)
        await outputs.aclose()
        return self._final(view, first[1], first[1].outputs[0].text, start, plan)

    def _final(
        self,
        view: _ResponseView,
        result: RequestOutput,
        text: str,
        start,
        plan: ToolPlan,
        num_output: int | None = None,
    ) -> dict:
        """The response to the whole reply `text` (of `num_output` tokens; None: the result's):
        its reasoning, message and calls."""
        reasoning = None
        if self.chat.reasoning_parser is not None:
            reasoning, text = split_reply(self.chat.reasoning_parser, text, *start)
        content, calls = reply(plan, text)
        num_reasoning = self._count(reasoning)
        return view.response(result, reasoning or None, content, calls, num_reasoning, num_output)

    def _count(self, reasoning: str | None) -> int:
        """Tokens of the reasoning (usage's reasoning_tokens), re-read from its text."""
        return len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    async def _stream_whole(
        self, view: _ResponseView, first, outputs: AsyncIterator, start, plan: ToolPlan
    ) -> AsyncIterator[str]:
        events = _Events()
        try:
            yield events.emit("response.created", response=view.shell("in_progress"))
            yield events.emit("response.in_progress", response=view.shell("in_progress"))
            item, text, num_output = first, "", 0
            while item is not None:
                result, text = item[1], text + item[1].outputs[0].text
                num_output += len(result.outputs[0].token_ids)
                item = await anext(outputs, None)
            final = self._final(view, result, text, start, plan, num_output)
            for line in view.replay(events, final["output"]):
                yield line
            yield events.emit(_closing_event(final), response=final)
        except OpenAIError as e:
            yield events.emit("error", message=e.message, code=e.code, param=e.param)
        finally:
            await outputs.aclose()

    async def _stream(
        self, view: _ResponseView, first, outputs: AsyncIterator, start: tuple[bool, bool]
    ) -> AsyncIterator[str]:
        events = _Events()
        parser = self.chat.reasoning_parser
        splitter = ReasoningSplitter(parser, *start) if parser is not None else None
        # Each output item's (started, delta, done) events, and its text so far.
        kinds = {
            "reasoning": (view.reasoning_started, view.reasoning_delta, view.reasoning_done),
            "message": (view.message_started, view.text_delta, view.message_done),
        }
        texts = {"reasoning": "", "message": ""}
        open_items: list[str] = []  # "reasoning", then "message", as each starts

        def send(name: str, delta: str | None) -> list[str]:
            """`name`'s item opened (the first time) and its `delta` sent (None: nothing)."""
            lines = []
            if name not in open_items:
                open_items.append(name)
                lines += kinds[name][0](events, len(open_items) - 1)
            if delta:
                texts[name] += delta
                lines.append(kinds[name][1](events, open_items.index(name), delta))
            return lines

        try:
            yield events.emit("response.created", response=view.shell("in_progress"))
            yield events.emit("response.in_progress", response=view.shell("in_progress"))
            item, result, num_output = first, None, 0
            while item is not None:
                result = item[1]
                c = result.outputs[0]
                num_output += len(c.token_ids)
                new_reasoning, new_text = "", c.text
                if splitter is not None:
                    new_reasoning, new_text = splitter.feed_delta(c.text, bool(c.finish_reason))
                for name, delta in (("reasoning", new_reasoning), ("message", new_text)):
                    for line in send(name, delta) if delta else ():
                        yield line
                item = await anext(outputs, None)
            for line in send("message", None):  # an empty reply is still a message
                yield line
            for index, name in enumerate(open_items):
                for line in kinds[name][2](events, index, texts[name]):
                    yield line
            reasoning, text = texts["reasoning"], texts["message"]
            num_reasoning = self._count(reasoning)
            final = view.response(result, reasoning or None, text, [], num_reasoning, num_output)
            yield events.emit(_closing_event(final), response=final)
        except OpenAIError as e:
            yield events.emit("error", message=e.message, code=e.code, param=e.param)
        finally:
            await outputs.aclose()


def _closing_event(final: dict) -> str:
    return "response.completed" if final["status"] == "completed" else "response.incomplete"


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
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "truncation": "disabled",
            "user": request.user,
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    def response(
        self,
        result: RequestOutput,
        reasoning: str | None,
        text: str | None,
        calls: list[dict],
        num_reasoning: int,
        num_output: int | None = None,
    ) -> dict:
        """The response to `result`: its reasoning item, its message (unless it only calls
        tools) and a function_call item per call (chat's tool_calls entries)."""
        completion = result.outputs[0]
        output = []
        if reasoning is not None:
            output.append(self._reasoning_item(reasoning, "completed"))
        if text or not calls:
            output.append(self._message_item(text or "", "completed"))
        output += [_call_item(call) for call in calls]
        incomplete = completion.finish_reason == "length"
        body = self.shell("incomplete" if incomplete else "completed", output)
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if num_output is None:  # a streamed result holds only its last tokens: the caller counts
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

    def replay(self, events: _Events, items: list[dict]) -> list[str]:
        """The events of whole output items, in order (a reply whose calls are known only at
        its end): each item added, its content in one delta, done."""
        lines = []
        for index, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                lines += self.message_started(events, index)
                lines.append(self.text_delta(events, index, text))
                lines += self.message_done(events, index, text)
            elif item["type"] == "reasoning":
                text = item["content"][0]["text"]
                lines += self.reasoning_started(events, index)
                lines.append(self.reasoning_delta(events, index, text))
                lines += self.reasoning_done(events, index, text)
            else:
                at = {"item_id": item["id"], "output_index": index}
                started = {**item, "arguments": "", "status": "in_progress"}
                lines += [
                    events.emit("response.output_item.added", output_index=index, item=started),
                    events.emit(
                        "response.function_call_arguments.delta", **at, delta=item["arguments"]
                    ),
                    events.emit(
                        "response.function_call_arguments.done", **at, arguments=item["arguments"]
                    ),
                    events.emit("response.output_item.done", output_index=index, item=item),
                ]
        return lines

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


def _call_item(call: dict) -> dict:
    """A chat tool_calls entry as a function_call output item."""
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
