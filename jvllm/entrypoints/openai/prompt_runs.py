"""Running the prompts (or choices) of one HTTP request through the engine at once: every prompt
checked before any runs, their outputs interleaved as they come, a beam search reported once at
its end, and leaving early aborting them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from typing import Any

from jvllm.engine.async_llm import AsyncLLM, RequestOutputKind
from jvllm.entrypoints.beam_search import beam_search_async
from jvllm.entrypoints.openai.engine_errors import engine_errors
from jvllm.lora.request import LoRARequest
from jvllm.outputs import CompletionOutput, RequestOutput
from jvllm.sampling_params import BeamSearchParams, SamplingParams


class PromptRuns:
    """What OpenAIServing runs its requests' prompts with; it reads the serving's `engine` and
    `tokenizer`."""

    engine: AsyncLLM
    tokenizer: Any

    async def generate_all(
        self,
        prompts: list[dict],
        params: SamplingParams,
        request_id: str,
        kind: RequestOutputKind,
        beam: BeamSearchParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        fields: Collection[str] = (),
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs from every prompt, as they come. Leaving early aborts all.
        With `beam`, each prompt is one beam search, reported once, at its end. `fields`: the
        request's, one of which the engine's refusal of a bad input names (a 400's `param`)."""
        options = (beam, priority, lora_request, fields)
        if len(prompts) == 1:
            async for output in self._generate(prompts[0], params, request_id, kind, *options):
                yield 0, output
            return

        # Every prompt is checked before any runs (vLLM's): a bad one refuses the request whole,
        # leaving nothing added and aborted.
        def check_all(engine) -> None:
            for index, prompt in enumerate(prompts):
                rid = f"{request_id}-{index}"
                engine.check_request(rid, prompt, params, None, priority, lora_request)

        with engine_errors(fields):
            await self.engine.call_engine(check_all)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, prompt: dict) -> None:
            rid = f"{request_id}-{index}"
            try:
                async for output in self._generate(prompt, params, rid, kind, *options):
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
        self,
        prompt: dict,
        params: SamplingParams,
        request_id: str,
        kind: RequestOutputKind,
        beam: BeamSearchParams | None,
        priority: int,
        lora_request: LoRARequest | None,
        fields: Collection[str],
    ) -> AsyncIterator[RequestOutput]:
        with engine_errors(fields):
            if beam is not None:
                yield await self._beam_search(prompt, beam, request_id, priority, lora_request)
                return
            options = {"output_kind": kind, "priority": priority, "lora_request": lora_request}
            async for output in self.engine.generate(prompt, params, request_id, **options):
                yield output

    async def _beam_search(
        self, prompt: dict, beam: BeamSearchParams, request_id: str, priority: int, lora_request
    ) -> RequestOutput:
        """One finished output whose completions are the best beams (vLLM's online beam search:
        the text leaves out a final EOS unless include_stop_str_in_output)."""
        prompt_ids = prompt["prompt_token_ids"]
        salt = prompt.get("cache_salt")
        found = await beam_search_async(
            self.engine, prompt_ids, beam, request_id, salt, priority, lora_request
        )
        eos = self.engine.engine.eos_token_ids
        outputs = []
        for index, sequence in enumerate(found.sequences):
            token_ids = sequence.tokens[len(prompt_ids) :]
            shown = token_ids
            if token_ids and token_ids[-1] in eos and not beam.include_stop_str_in_output:
                shown = token_ids[:-1]
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=self.tokenizer.decode(shown),
                    token_ids=token_ids,
                    cumulative_logprob=sequence.cum_logprob,
                    finish_reason=sequence.finish_reason,
                    stop_reason=sequence.stop_reason,
                )
            )
        return RequestOutput(request_id, prompt.get("prompt"), prompt_ids, outputs, finished=True)
