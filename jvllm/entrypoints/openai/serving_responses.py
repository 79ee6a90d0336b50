"""POST /v1/responses: OpenAI's Responses API over the chat template, as vLLM serves it: `input`
(a string, or message and function-call items) after `instructions`, function tools, one reply,
given whole or as the API's typed stream events. With --reasoning-parser a thinking model's
reasoning is an output item of its own; tool calls are function_call items, forced or parsed
out of the text as on /v1/chat/completions, and streamed as they are parsed
(responses_stream.py). `include: ["message.output_text.logprobs"]` puts the tokens' logprobs on
the message's text. Responses are not stored (vLLM's default), so `previous_response_id` is
refused (unsupported.py)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator

from jvllm.entrypoints.openai.protocol import OpenAIError, ResponsesRequest
from jvllm.entrypoints.openai.reasoning import split_reply
from jvllm.entrypoints.openai.responses_input import chat_messages, chat_tools_request
from jvllm.entrypoints.openai.responses_items import Events, ResponseView, reply_items
from jvllm.entrypoints.openai.responses_stream import ResponseStream
from jvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jvllm.entrypoints.openai.serving_engine import OpenAIServing
from jvllm.entrypoints.openai.structured import structured_outputs
from jvllm.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan, plan_tools, reply
from jvllm.outputs import CompletionOutput, RequestOutput
from jvllm.sampling_params import RequestOutputKind

# The fields shared with chat and completions (protocol._SamplingFields) that a response has no
# place for, with the value that leaves them unused.
_CHAT_ONLY_FIELDS = {
    "prompt_logprobs": None,
    "return_token_ids": False,
    "return_tokens_as_token_ids": False,
}
# The `include` value that asks for the message's logprobs, and OpenAI's most top_logprobs.
_OUTPUT_LOGPROBS = "message.output_text.logprobs"
_MAX_TOP_LOGPROBS = 20


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        """Renders through `chat` (its template, trust, tool and reasoning parsers)."""
        super().__init__(chat.engine, chat.model_names)
        self.chat = chat
        self.reads_special_tokens = chat.reads_special_tokens

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
            len(prompt_token_ids), request.max_output_tokens, "input", "max_output_tokens"
        )
        logprobs = self._num_logprobs(request)
        params = self.sampling_params(request, max_tokens, logprobs, constraint=constraint)
        response_id = f"resp_{request.request_id or uuid.uuid4().hex}"
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        prompt = {
            "prompt": None,
            "prompt_token_ids": prompt_token_ids,
            "cache_salt": request.cache_salt,
        }
        options = (None, request.priority, adapter, type(request).model_fields)
        outputs = self.generate_all([prompt], params, response_id, kind, *options)
        try:
            first = await anext(outputs)  # errors at admission become a 400, not a broken stream
        except StopAsyncIteration:
            first = None
        # How the reply starts, for the reasoning parser: inside a thought, under a constraint.
        start = (self.chat.opens_thought(prompt_token_ids), constraint is not None)
        name = self.models.reply_name(request.model)
        view = ResponseView(request, response_id, name, len(prompt_token_ids))
        if request.stream:
            stream = self._reply_stream(request, start, plan, logprobs)
            return self._stream(view, first, outputs, stream)
        await outputs.aclose()
        return self._final(view, first[1], start, plan, logprobs)

    def _num_logprobs(self, request: ResponsesRequest) -> int | None:
        """The top logprobs per token the reply's text carries (vLLM's: `top_logprobs` with
        "message.output_text.logprobs" in `include`), None without that."""
        for value in request.include or []:
            if value != _OUTPUT_LOGPROBS:
                raise OpenAIError(
                    f"include {value!r} is not served; jvllm includes only {_OUTPUT_LOGPROBS!r}",
                    param="include",
                )
        top = request.top_logprobs or 0
        limit = min(_MAX_TOP_LOGPROBS, self.max_logprobs)
        if not 0 <= top <= limit:
            raise OpenAIError(
                f"top_logprobs must be in [0, {limit}], got {top}", param="top_logprobs"
            )
        return top if _OUTPUT_LOGPROBS in (request.include or []) else None

    def _logprobs(
        self, request: ResponsesRequest, num: int, completion: CompletionOutput
    ) -> list[dict]:
        """The logprobs of `completion`'s tokens, `num` top each, as output_text carries them."""
        return self.chat.logprobs_json(request, completion, num)["content"]

    def _final(
        self,
        view: ResponseView,
        result: RequestOutput,
        start,
        plan: ToolPlan,
        num_logprobs: int | None,
    ) -> dict:
        """The response to the whole reply: its reasoning, message and calls."""
        completion = result.outputs[0]
        reasoning, text = None, completion.text
        if self.chat.reasoning_parser is not None:
            reasoning, text = split_reply(self.chat.reasoning_parser, text, *start)
        content, calls = reply(plan, text)
        logprobs = []
        if num_logprobs is not None:
            logprobs = self._logprobs(view.request, num_logprobs, completion)
        items = reply_items(reasoning or None, content, calls, logprobs)
        return view.response(result, items, self._count(reasoning), len(completion.token_ids))

    def _count(self, reasoning: str | None) -> int:
        """Tokens of the reasoning (usage's reasoning_tokens), re-read from its text."""
        return len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    def _reply_stream(
        self, request: ResponsesRequest, start, plan: ToolPlan, num_logprobs: int | None
    ) -> ResponseStream:
        parser = self.chat.reasoning_parser
        splitter = parser.splitter(*start) if parser is not None else None
        calls = ToolCallStream(plan) if plan.mode != "none" else None
        logprobs = None
        if num_logprobs is not None:
            logprobs = functools.partial(self._logprobs, request, num_logprobs)
        return ResponseStream(Events(), splitter, calls, logprobs)

    async def _stream(
        self, view: ResponseView, first, outputs: AsyncIterator, stream: ResponseStream
    ) -> AsyncIterator[str]:
        events = stream.events
        try:
            yield events.emit("response.created", response=view.shell("in_progress"))
            yield events.emit("response.in_progress", response=view.shell("in_progress"))
            item, result, num_output = first, None, 0
            while item is not None:
                result = item[1]
                num_output += len(result.outputs[0].token_ids)
                for line in stream.feed(result.outputs[0]):
                    yield line
                item = await anext(outputs, None)
            for line in stream.finish():
                yield line
            num_reasoning = self._count(stream.reasoning)
            final = view.response(result, stream.output, num_reasoning, num_output)
            yield events.emit(_closing_event(final), response=final)
        except OpenAIError as e:
            yield events.emit("error", message=e.message, code=e.code, param=e.param)
        finally:
            await outputs.aclose()


def _closing_event(final: dict) -> str:
    return "response.completed" if final["status"] == "completed" else "response.incomplete"
