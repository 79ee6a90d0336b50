"""What completions and chat share: model check, sampling params, length checks, logprobs,
and running several prompts (or choices) of one HTTP request through the engine at once."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from jvllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestOutputKind
from jvllm.entrypoints.openai.protocol import OpenAIError
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.engine.args.max_logprobs
        # The model's generation_config.json defaults, for the fields a request leaves out.
        self.defaults = engine.engine.generation_config.sampling_defaults

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self, request, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's SamplingParams for a request; out-of-range values become a 400 that
        names the parameter."""
        values = {
            "n": request.n,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "min_p": request.min_p,
            "seed": request.seed,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "max_tokens": max_tokens,
            "min_tokens": request.min_tokens,
            "ignore_eos": request.ignore_eos,
            "skip_special_tokens": request.skip_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        if request.logit_bias:
            try:
                values["logit_bias"] = {int(k): float(v) for k, v in request.logit_bias.items()}
            except ValueError:
                raise OpenAIError("logit_bias keys must be token ids", param="logit_bias") from None
        if logprobs is not None and not 0 <= logprobs <= self.max_logprobs:
            raise OpenAIError(
                f"logprobs must be in [0, {self.max_logprobs}], got {logprobs}", param="logprobs"
            )
        kwargs = {name: value for name, value in values.items() if value is not None}
        kwargs = {**self.defaults, **kwargs}  # max_tokens is always the request's (check_length)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            message = str(e)
            first = message.split(" ", 1)[0]
            raise OpenAIError(message, param=first if first in values else None) from None

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """The request's max_tokens, checked against max_model_len (None: all the room left),
        and at most the model's max_new_tokens when its generation_config.json sets one (as
        vLLM does)."""
        room = self.max_model_len - num_prompt_tokens
        cap = self.defaults.get("max_tokens", room)
        if max_tokens is None:
            if room < 1:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens; your "
                    f"prompt has {num_prompt_tokens} tokens, which leaves no room for output.",
                    param=param,
                    code="context_length_exceeded",
                )
            return min(room, cap)
        if max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for the completion). Please reduce the prompt or "
                "max_tokens.",
                param=param,
                code="context_length_exceeded",
            )
        return min(max_tokens, cap)

    async def generate_all(
        self, prompts: list[dict], params: SamplingParams, request_id: str, kind: RequestOutputKind
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs from every prompt, as they come. Leaving early aborts all."""
        if len(prompts) == 1:
            async for output in self._generate(prompts[0], params, request_id, kind):
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, prompt: dict) -> None:
            try:
                async for output in self._generate(prompt, params, f"{request_id}-{index}", kind):
                    queue.put_nowait((index, output))
            except BaseException as e:
                queue.put_nowait((index, e))
                raise
            queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(
        self, prompt: dict, params: SamplingParams, request_id: str, kind: RequestOutputKind
    ) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self.engine.generate(prompt, params, request_id, output_kind=kind):
                yield output
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e)) from None
        except EngineDeadError as e:
            raise OpenAIError(str(e), status_code=500, type="internal_server_error") from None

    # ---- logprobs ----

    def token_text(self, token_id: int, logprob) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    @staticmethod
    def logprob_value(logprob) -> float:
        value = getattr(logprob, "logprob", logprob)
        return max(float(value), -9999.0)  # JSON has no -inf

    def top_entries(self, position: dict, num: int) -> list[tuple[int, object]]:
        """The `num` most likely (token id, Logprob) of one position's dict."""
        ranked = sorted(position.items(), key=lambda kv: -self.logprob_value(kv[1]))
        return ranked[:num]


def now() -> int:
    return int(time.time())


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
