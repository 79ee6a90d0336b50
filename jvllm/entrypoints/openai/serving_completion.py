"""POST /v1/completions: one or several prompts (text or token ids), streamed or not."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from jvllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError
from jvllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    now,
    response_id,
    sse,
    usage,
)
from jvllm.entrypoints.openai.structured import structured_outputs
from jvllm.outputs import CompletionOutput, RequestOutput
from jvllm.sampling_params import RequestOutputKind


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> list[dict]:
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise OpenAIError("prompt must not be empty", param="prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise OpenAIError("prompt must not be empty", param="prompt")
                self.check_prompt_chars(len(p), "prompt", request)
                ids = self.tokenizer.encode(p, add_special_tokens=request.add_special_tokens)
                ids = self.truncated(ids, request)
                out.append({"prompt": p, "prompt_token_ids": ids, "cache_salt": request.cache_salt})
            else:
                if not p:
                    raise OpenAIError("prompt must not be empty (it has 0 tokens)", param="prompt")
                ids = self.truncated(list(p), request)
                out.append(
                    {"prompt": None, "prompt_token_ids": ids, "cache_salt": request.cache_salt}
                )
        return out

    async def create(self, request: CompletionRequest):
        """A response dict, or an async iterator of SSE lines when streaming."""
        adapter = self.check_model(request.model)
        self.check_request(request)
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of must equal n (every sample is returned)", param="best_of")
        prompts = self._prompts(request)
        # echo with max_tokens 0 (vLLM's): the prompt and its logprobs alone; the engine samples
        # one token, which the response leaves out.
        asked = 1 if _echo_only(request) else request.max_tokens
        # One SamplingParams serves every prompt: without max_tokens, the room the longest leaves.
        max_tokens = min(
            self.check_length(len(p["prompt_token_ids"]), asked, "prompt") for p in prompts
        )
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:  # echoed logprobs are the prompt's
            prompt_logprobs = request.logprobs
        params = self.sampling_params(
            request, max_tokens, request.logprobs, prompt_logprobs, structured_outputs(request)
        )
        beam = self.beam_search_params(request, max_tokens)
        request_id = response_id("cmpl", request.request_id)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        options = (beam, request.priority, adapter, type(request).model_fields)
        outputs = self.generate_all(prompts, params, request_id, kind, *options)
        try:
            first = await anext(outputs)  # errors at admission become a 400, not a broken stream
        except StopAsyncIteration:
            first = None
        if request.stream:
            return self._stream(request, request_id, params.n, first, outputs)
        results: dict[int, RequestOutput] = {}
        item = first
        try:
            while item is not None:
                results[item[0]] = item[1]
                item = await anext(outputs, None)
        finally:
            await outputs.aclose()
        return self._response(
            request, request_id, params.n, [results[i] for i in range(len(prompts))]
        )

    def _response(self, request, request_id: str, n: int, results: list[RequestOutput]) -> dict:
        choices = []
        num_prompt = num_completion = 0
        for prompt_index, result in enumerate(results):
            num_prompt += len(result.prompt_token_ids)
            for completion in result.outputs:
                completion = _shown(request, completion)
                num_completion += len(completion.token_ids)
                choices.append(self._choice(request, result, completion, prompt_index * n, True))
        choices.sort(key=lambda c: c["index"])
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.models.reply_name(request.model),
            "choices": choices,
            "usage": usage(num_prompt, num_completion),
        }

    def _choice(
        self,
        request,
        result: RequestOutput,
        completion: CompletionOutput,
        base: int,
        first: bool,
        text_offset: int = 0,
    ) -> dict:
        """One choice of a response or of a stream's chunk, whose text starts at `text_offset`
        of the choice's whole text (logprobs' text_offset counts from the choice's start)."""
        text = completion.text
        echo = request.echo and first
        if echo:
            text = self._prompt_text(result) + text
        logprobs = None
        if request.logprobs is not None:
            logprobs = self._logprobs(
                result, completion, echo, request.return_tokens_as_token_ids, text_offset
            )
        choice = {
            "index": base + completion.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_json(result.prompt_logprobs)
        if request.return_token_ids:  # vLLM's: the prompt's ids with a choice's first chunk
            if first:
                choice["prompt_token_ids"] = list(result.prompt_token_ids)
            choice["token_ids"] = list(completion.token_ids)
        return choice

    def _prompt_text(self, result: RequestOutput) -> str:
        if result.prompt is not None:
            return result.prompt
        return self.tokenizer.decode(result.prompt_token_ids)

    def _logprobs(
        self,
        result: RequestOutput,
        completion: CompletionOutput,
        echo: bool,
        as_ids: bool,
        offset: int,
    ) -> dict:
        """OpenAI's legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
        token_ids: list[int] = []
        positions: list = []
        if echo:
            prompt_lps = getattr(result, "prompt_logprobs", None) or []
            token_ids += list(result.prompt_token_ids)
            positions += list(prompt_lps) + [None] * (
                len(result.prompt_token_ids) - len(prompt_lps)
            )
        token_ids += list(completion.token_ids)
        positions += list(completion.logprobs or [None] * len(completion.token_ids))
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position else None
            text = self.token_text(token_id, chosen, as_ids)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if position is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(self.logprob_value(chosen) if chosen is not None else None)
            # The top k and the sampled token (k + 1 entries when it is not among them).
            top.append(
                {
                    self.token_text(t, lp, as_ids): self.logprob_value(lp)
                    for t, lp in self.top_entries(position, len(position))
                }
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    async def _stream(
        self, request, request_id: str, n: int, first, outputs: AsyncIterator
    ) -> AsyncIterator[str]:
        created = now()
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        num_prompt: dict[int, int] = {}
        num_completion: dict[int, int] = {}  # each choice's tokens sent so far, by index
        text_lens: dict[int, int] = {}  # each choice's text sent so far, by index

        def chunk(choices: list[dict], chunk_usage: dict | None) -> str:
            body = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.models.reply_name(request.model),
                "choices": choices,
            }
            if include_usage:
                body["usage"] = chunk_usage
            return sse(body)

        item = first
        try:
            while item is not None:
                prompt_index, result = item
                num_prompt[prompt_index] = len(result.prompt_token_ids)
                # One choice a chunk, as vLLM streams them: continuous_usage_stats then counts
                # that choice's prompt and its tokens so far.
                for completion in result.outputs:
                    completion = _shown(request, completion)
                    index = prompt_index * n + completion.index
                    num_completion[index] = num_completion.get(index, 0) + len(completion.token_ids)
                    choice = self._choice(
                        request,
                        result,
                        completion,
                        prompt_index * n,
                        index not in text_lens,
                        text_lens.get(index, 0),
                    )
                    text_lens[index] = text_lens.get(index, 0) + len(choice["text"])
                    counts = (num_prompt[prompt_index], num_completion[index])
                    yield chunk([choice], usage(*counts) if continuous else None)
                item = await anext(outputs, None)
            if include_usage:
                total = (sum(num_prompt.values()), sum(num_completion.values()))
                yield chunk([], usage(*total))
        except OpenAIError as e:
            yield sse(e.body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"


def _echo_only(request: CompletionRequest) -> bool:
    return request.echo and request.max_tokens == 0


def _shown(request: CompletionRequest, completion: CompletionOutput) -> CompletionOutput:
    """What the response shows of a completion: nothing of the token sampled for an echo
    with max_tokens 0."""
    if not _echo_only(request):
        return completion
    return dataclasses.replace(
        completion,
        text="",
        token_ids=[],
        cumulative_logprob=None,
        logprobs=None if completion.logprobs is None else [],
    )
