"""POST /v1/chat/completions: messages through the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator

from jvllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from jvllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    now,
    random_id,
    sse,
    usage,
)
from jvllm.outputs import CompletionOutput
from jvllm.sampling_params import RequestOutputKind


class OpenAIServingChat(OpenAIServing):
    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
    ) -> list[int]:
        """The prompt token ids of a conversation under the tokenizer's chat template."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model's tokenizer has no chat template", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise OpenAIError(
                    f"messages[{i}] must be an object with a 'role'", param="messages"
                )
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=True,
                **(kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - a template error is the messages' fault
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        return list(encoded["input_ids"])

    async def create(self, request: ChatCompletionRequest):
        """A response dict, or an async iterator of SSE lines when streaming."""
        self.check_model(request.model)
        prompt_token_ids = self.render(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        max_tokens = self.check_length(len(prompt_token_ids), max_tokens, "messages")
        top = request.top_logprobs
        if top is not None and not 0 <= top <= self.max_logprobs:
            raise OpenAIError(
                f"top_logprobs must be in [0, {self.max_logprobs}], got {top}", param="top_logprobs"
            )
        if top and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (top or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs)
        request_id = random_id("chatcmpl")
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        prompt = {"prompt": None, "prompt_token_ids": prompt_token_ids}
        outputs = self.generate_all([prompt], params, request_id, kind)
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            first = None
        if request.stream:
            return self._stream(request, request_id, params.n, first, outputs)
        result = first[1]
        await outputs.aclose()
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c, top or 0) if request.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in sorted(result.outputs, key=lambda c: c.index)
        ]
        num_prompt = len(result.prompt_token_ids)
        num_completion = sum(len(c.token_ids) for c in result.outputs)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(num_prompt, num_completion),
        }

    def _logprobs(self, completion: CompletionOutput, num: int) -> dict:
        content = []
        for token_id, position in zip(completion.token_ids, completion.logprobs or []):
            chosen = position.get(token_id)
            text = self.token_text(token_id, chosen)
            content.append(
                {
                    "token": text,
                    "logprob": self.logprob_value(chosen) if chosen is not None else -9999.0,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := self.token_text(tid, lp)),
                            "logprob": self.logprob_value(lp),
                            "bytes": list(t.encode()),
                        }
                        for tid, lp in self.top_entries(position, num)
                    ],
                }
            )
        return {"content": content}

    async def _stream(
        self, request, request_id: str, n: int, first, outputs: AsyncIterator
    ) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        top = request.top_logprobs or 0

        def chunk(choices: list[dict], usage_body: dict | None = None) -> str:
            body = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = usage_body
            return sse(body)

        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(n)
            ]
        )
        num_prompt = num_completion = 0
        item = first
        try:
            while item is not None:
                result = item[1]
                num_prompt = len(result.prompt_token_ids)
                deltas, finals = [], []
                for c in result.outputs:
                    num_completion += len(c.token_ids)
                    if c.text or c.token_ids:
                        deltas.append(
                            {
                                "index": c.index,
                                "delta": {"content": c.text},
                                "logprobs": self._logprobs(c, top) if request.logprobs else None,
                                "finish_reason": None,
                            }
                        )
                    if c.finish_reason:
                        finals.append(
                            {
                                "index": c.index,
                                "delta": {},
                                "logprobs": None,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                            }
                        )
                if deltas:
                    yield chunk(deltas)
                if finals:
                    yield chunk(finals)
                item = await anext(outputs, None)
            if include_usage:
                yield chunk(
                    [],
                    usage(num_prompt, num_completion),
                )
        except OpenAIError as e:
            yield sse(e.body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"
