"""POST /v1/chat/completions: messages through the tokenizer's chat template."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.chat import chat_images, has_images, text_content
from jvllm.entrypoints.openai.chat_rendering import ChatRendering
from jvllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from jvllm.entrypoints.openai.reasoning import (
    ReasoningParser,
    add_reasoning,
    prompt_opens_thought,
    split_reply,
)
from jvllm.entrypoints.openai.serving_engine import OpenAIServing, now, response_id, sse, usage
from jvllm.entrypoints.openai.structured import structured_outputs
from jvllm.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan, plan_tools, reply
from jvllm.entrypoints.openai.tool_parsers import ToolParser
from jvllm.outputs import CompletionOutput
from jvllm.sampling_params import RequestOutputKind


class OpenAIServingChat(ChatRendering, OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        model_names: str | list[str],
        trust_request_chat_template: bool,
        tool_parser: type[ToolParser] | None = None,
        chat_template: str | None = None,
        response_role: str = "assistant",
        reasoning_parser: ReasoningParser | None = None,
    ):
        """`tool_parser`: the parser of tool_choice "auto" (--enable-auto-tool-choice and
        --tool-call-parser), None when "auto" is refused. `chat_template`: the server's
        (--chat-template), instead of the tokenizer's. `response_role`: the reply's role after
        a generation prompt (--response-role). `reasoning_parser` (--reasoning-parser): splits
        a thinking model's reasoning from its content (reasoning.py)."""
        super().__init__(engine, model_names)
        self.reasoning_parser = reasoning_parser
        parsers = (reasoning_parser, tool_parser)  # harmony's read its special tokens (vLLM's)
        self.reads_special_tokens = any(p and p.reads_special_tokens for p in parsers)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser = tool_parser
        self.chat_template = chat_template
        self.response_role = response_role
        # How image_url parts reach the model (None: it takes no images); image_pil parts are
        # the offline API's.
        self.images = chat_images(engine.engine, takes_pil=False)

    def _role(self, request: ChatCompletionRequest) -> str:
        """The reply's role (vLLM's): the response role after a generation prompt, else the role
        of the message it continues."""
        if request.add_generation_prompt and not request.continue_final_message:
            return self.response_role
        return request.messages[-1]["role"]

    @staticmethod
    def _echo(request: ChatCompletionRequest, role: str) -> str:
        """With echo, the text the reply starts with: the last message's when it has the reply's
        role (continue_final_message, or an assistant's message before a generation prompt), as
        vLLM does."""
        if not request.echo or request.messages[-1].get("role") != role:
            return ""
        return text_content(request.messages[-1:])[0].get("content") or ""

    async def create(self, request: ChatCompletionRequest):
        """A response dict, or an async iterator of SSE lines when streaming."""
        adapter = self.check_model(request.model)
        self.check_request(request)
        tools = plan_tools(request, self.tool_parser)
        constraint = structured_outputs(request)
        if tools.constraint is not None:
            if constraint is not None:
                raise OpenAIError(
                    f"tool_choice {request.tool_choice!r} already constrains the reply; "
                    "leave out response_format and structured_outputs",
                    param="tool_choice",
                )
            constraint = tools.constraint
        self.check_prompt_chars(_num_text_chars(request.messages), "messages", request)
        render = functools.partial(
            self.render_prompt,
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.chat_template,
            request.add_special_tokens,
            request.tools,
        )
        # Images are fetched (http(s) with a timeout) off the event loop.
        rendered = await asyncio.to_thread(render) if has_images(request.messages) else render()
        prompt_token_ids = self.truncated(rendered["prompt_token_ids"], request)
        max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
        max_tokens = self.check_length(
            len(prompt_token_ids), max_tokens, "messages", max_tokens_param
        )
        top = request.top_logprobs
        if top is not None and not 0 <= top <= self.max_logprobs:
            raise OpenAIError(
                f"top_logprobs must be in [0, {self.max_logprobs}], got {top}", param="top_logprobs"
            )
        if top and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (top or 0) if request.logprobs else None
        params = self.sampling_params(
            request, max_tokens, logprobs, request.prompt_logprobs, constraint
        )
        beam = self.beam_search_params(request, max_tokens)
        request_id = response_id("chatcmpl", request.request_id)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        prompt = {
            "prompt": None,
            "prompt_token_ids": prompt_token_ids,
            "cache_salt": request.cache_salt,
        }
        if "multi_modal_data" in rendered:
            prompt["multi_modal_data"] = rendered["multi_modal_data"]
        options = (beam, request.priority, adapter, type(request).model_fields)
        outputs = self.generate_all([prompt], params, request_id, kind, *options)
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            first = None
        # How each reply starts, for the reasoning parser: inside a thought, under a constraint.
        start = (self.opens_thought(prompt_token_ids), constraint is not None)
        if request.stream:
            return self._stream(request, request_id, params.n, first, outputs, tools, start)
        result = first[1]
        await outputs.aclose()
        role = self._role(request)
        echo = self._echo(request, role)
        choices = []
        for c in sorted(result.outputs, key=lambda c: c.index):
            text, reasoning = c.text, None
            if self.reasoning_parser is not None:
                reasoning, text = split_reply(self.reasoning_parser, c.text, *start)
            content, calls = reply(tools, text)
            if reasoning and not content:
                content = None  # a reply that only thought (vLLM's)
            message = {"role": role, "content": echo + content if content is not None else None}
            if self.reasoning_parser is not None:
                add_reasoning(message, reasoning or None, request.include_reasoning)
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": self.logprobs_json(request, c, top or 0) if request.logprobs else None,
                "finish_reason": _finish_reason(c.finish_reason, bool(calls), tools.mode),
                "stop_reason": c.stop_reason,
            }
            if request.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        num_prompt = len(result.prompt_token_ids)
        num_completion = sum(len(c.token_ids) for c in result.outputs)
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.models.reply_name(request.model),
            "choices": choices,
            "usage": usage(num_prompt, num_completion),
        }
        if request.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.prompt_logprobs_json(result.prompt_logprobs)
        if request.return_token_ids:
            response["prompt_token_ids"] = list(result.prompt_token_ids)
        return response

    def logprobs_json(self, request, completion: CompletionOutput, num: int) -> dict:
        as_ids = request.return_tokens_as_token_ids
        content = []
        for token_id, position in zip(completion.token_ids, completion.logprobs or []):
            chosen = position.get(token_id)
            text = self.token_text(token_id, chosen, as_ids)
            content.append(
                {
                    "token": text,
                    "logprob": self.logprob_value(chosen) if chosen is not None else -9999.0,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := self.token_text(tid, lp, as_ids)),
                            "logprob": self.logprob_value(lp),
                            "bytes": list(t.encode()),
                        }
                        for tid, lp in self.top_entries(position, num)
                    ],
                }
            )
        return {"content": content}

    def opens_thought(self, prompt_token_ids: list[int]) -> bool:
        """Whether the rendered prompt ends inside an opened thought (reasoning.py)."""
        if self.reasoning_parser is None:
            return False
        tail = self.tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:])
        return prompt_opens_thought(self.reasoning_parser, tail)

    async def _stream(
        self,
        request,
        request_id: str,
        n: int,
        first,
        outputs: AsyncIterator,
        tools: ToolPlan,
        start: tuple[bool, bool],
    ) -> AsyncIterator[str]:
        created = now()
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        top = request.top_logprobs or 0
        role = self._role(request)
        echo = self._echo(request, role)
        num_prompt = len(first[1].prompt_token_ids) if first is not None else 0
        num_tokens = [0] * n  # each choice's completion tokens so far

        def chunk(choice: dict | None, **extra) -> str:
            """A chunk of one choice (vLLM's shape, for any n), or of none: the last one, with
            the usage where asked."""
            body = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.models.reply_name(request.model),
                "choices": [] if choice is None else [choice],
                **extra,
            }
            if choice is None:
                body["usage"] = usage(num_prompt, sum(num_tokens))
            elif include_usage:  # vLLM's continuous_usage_stats: the choice's counts so far
                body["usage"] = (
                    usage(num_prompt, num_tokens[choice["index"]]) if continuous else None
                )
            return sse(body)

        extra = {}
        if request.return_token_ids and first is not None:
            extra["prompt_token_ids"] = list(first[1].prompt_token_ids)
        for i in range(n):
            role_delta = {"role": role, "content": ""}
            yield chunk(
                {"index": i, "delta": role_delta, "logprobs": None, "finish_reason": None},
                **extra,
            )
        if echo:
            for i in range(n):
                yield chunk(_choice_delta(i, {"content": echo}))
        streams = [ToolCallStream(tools) if tools.mode != "none" else None for _ in range(n)]
        parser = self.reasoning_parser
        splitters = [parser.splitter(*start) if parser else None for _ in range(n)]
        item = first
        try:
            while item is not None:
                result = item[1]
                for c in result.outputs:
                    num_tokens[c.index] += len(c.token_ids)
                    calls = streams[c.index]
                    text, reasoning, tail = c.text, "", None
                    if splitters[c.index] is not None:
                        reasoning, text = splitters[c.index].feed_delta(
                            c.text, bool(c.finish_reason)
                        )
                    if calls is None:
                        content = {"content": text} if text or c.token_ids else None
                    else:
                        content = calls.feed(text)
                        tail = calls.finish() if c.finish_reason else None
                    if reasoning and request.include_reasoning:
                        content = content or {}
                        if not text:
                            content.pop("content", None)
                        add_reasoning(content, reasoning, True)
                    # This output's chunks: its delta, then what the tool-call parser held back;
                    # the last carries the finish_reason (vLLM's), an empty delta if none is left.
                    choices = [_choice_delta(c.index, d) for d in (content, tail) if d]
                    if c.finish_reason:
                        if not choices:
                            choices.append(_choice_delta(c.index, {}))
                        choices[-1]["finish_reason"] = _finish_reason(
                            c.finish_reason, calls is not None and calls.called, tools.mode
                        )
                        choices[-1]["stop_reason"] = c.stop_reason
                    if choices and request.logprobs:  # the output's tokens, once
                        choices[0]["logprobs"] = self.logprobs_json(request, c, top)
                    if choices and request.return_token_ids:
                        choices[0]["token_ids"] = list(c.token_ids)
                    for choice in choices:
                        yield chunk(choice)
                item = await anext(outputs, None)
            if include_usage:
                yield chunk(None)
        except OpenAIError as e:
            yield sse(e.body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"


def _num_text_chars(messages: list) -> int:
    """The characters of the messages' text content, which the chat template's prompt holds."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else [content]:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text) if isinstance(text, str) else 0
    return total


def _finish_reason(reason: str | None, called: bool, tool_mode: str) -> str | None:
    """A reply that made tool calls and ended on its own finishes with "tool_calls" (OpenAI's),
    except a call of the function that tool_choice named, which finishes with "stop" (OpenAI's
    and vLLM's)."""
    return "tool_calls" if called and reason == "stop" and tool_mode != "named" else reason


def _choice_delta(index: int, delta: dict) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


# Tokens of the prompt's end decoded to see whether it opens a thought: enough for any tag.
_PROMPT_TAIL_TOKENS = 8
