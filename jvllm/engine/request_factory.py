"""A request's prompt and parameters, checked at the edge, made into the engine's Request
objects: a generation request's one, or the n samples of a prompt that share its KV blocks
through the prefix cache; a pooling request's one (runner="pooling"). Nothing here is
registered anywhere: LLMEngine.add_request does that once the whole request is known to be
good, so a bad one leaves no trace."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jvllm.config import ModelConfig
from jvllm.core.request import Request
from jvllm.engine.input_processor import (
    PromptType,
    check_priority,
    prompt_cache_salt,
    tokenize_prompt,
    validate_request,
)
from jvllm.engine.mm_processor import (
    MultiModalProcessor,
    ProcessedPrompt,
    check_no_images,
    image_architectures,
)
from jvllm.engine.parallel_sampling import ParentRequest, child_params
from jvllm.engine.pooling import PoolingOutputProcessor
from jvllm.lora.config import check_adapter
from jvllm.outputs import RequestMetrics
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import SamplingParams
from jvllm.structured_output.manager import GrammarState, StructuredOutputManager
from jvllm.worker.bias_rows import bad_words_token_ids


class RequestFactory:
    """`seed` seeds the seeds of requests that bring none (EngineArgs.seed);
    `default_params()`: a generation request's SamplingParams where it brings none;
    `adapters`: the runner's LoRA AdapterSlots (None: it serves none); `pooling`: a pooling
    engine's processor, else None; `mm_processor`: a model that takes images'
    (engine/mm_processor.py), else None."""

    def __init__(
        self,
        tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        max_logprobs: int,
        eos_token_ids: tuple[int, ...],
        structured_outputs: StructuredOutputManager,
        seed: int,
        default_params: Callable[[], SamplingParams],
        scheduling_policy: str,
        adapters=None,
        pooling: PoolingOutputProcessor | None = None,
        mm_processor: MultiModalProcessor | None = None,
        max_whole_image_tokens: int | None = None,
    ):
        self.default_params = default_params
        self.scheduling_policy = scheduling_policy
        self.adapters = adapters
        self.pooling = pooling
        self.mm_processor = mm_processor
        # A model whose images are computed in one step (Gemma 3): the step's token budget.
        self.max_whole_image_tokens = max_whole_image_tokens
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_ids = eos_token_ids
        self.structured_outputs = structured_outputs
        self._seed_rng = np.random.default_rng(seed)

    def make(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None,
        arrival_time: float | None,
        priority: int,
        lora_request,
        *,
        is_in_use: Callable[[str], bool],
    ) -> tuple[ParentRequest | None, list[Request]]:
        """Every check of add_request, and the requests it would enqueue -> (the parent of
        n > 1 samples or None, the requests); raises ValueError or TypeError naming what is
        wrong, e.g. an id (or a sample's) for which `is_in_use`."""
        if params is None and self.pooling is None:
            params = self.default_params()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if is_in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority, self.scheduling_policy)
        check_adapter(lora_request, self.adapters)
        arrival_time = time.time() if arrival_time is None else arrival_time
        if self.pooling is not None or isinstance(params, PoolingParams):
            args = (request_id, prompt, params, arrival_time, priority, lora_request)
            return None, [self._make_pooling(*args)]
        return self._make_generation(
            request_id, prompt, params, arrival_time, priority, lora_request, is_in_use
        )

    def _make_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams | None,
        arrival_time: float,
        priority: int,
        lora_request,
    ) -> Request:
        """A request whose prompt is pooled into one vector (runner="pooling" only)."""
        if lora_request is not None:
            raise ValueError("LoRA adapters do not serve embeddings: pass lora_request=None")
        if self.pooling is None:
            raise ValueError(
                "PoolingParams need an embedding engine: start it with runner='pooling' "
                "(LLM(..., runner='pooling'), jvllm serve --runner pooling)"
            )
        check_no_images(prompt, "pooling requests take no images")
        _, prompt_token_ids = tokenize_prompt(prompt, self.tokenizer)
        return self.pooling.make_request(
            request_id,
            prompt_token_ids,
            params,
            arrival_time,
            priority,
            prompt_cache_salt(prompt),
        )

    def _make_generation(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float,
        priority: int,
        lora_request,
        is_in_use: Callable[[str], bool],
    ) -> tuple[ParentRequest | None, list[Request]]:
        """(the parent of n > 1 samples or None, the requests to run)."""
        processed = None
        if self.mm_processor is None:
            check_no_images(
                prompt,
                f"this model ({self.model_config.architecture}) takes no images; the families "
                f"that do: {', '.join(image_architectures())}",
            )
        if (
            self.mm_processor is not None
            and isinstance(prompt, dict)
            and (prompt.get("multi_modal_data"))
        ):
            processed = prompt["multi_modal_data"]  # AsyncLLM processes it off this thread
            if not isinstance(processed, ProcessedPrompt):
                processed = self.mm_processor.process(prompt, self.tokenizer)
            prompt_text, prompt_token_ids = processed.text, processed.token_ids
        else:
            prompt_text, prompt_token_ids = tokenize_prompt(prompt, self.tokenizer)
        vocab_size = self.model_config.vocab_size
        num_tokens = len(prompt_token_ids)
        prompt_token_ids, params = validate_request(
            prompt_token_ids,
            params,
            vocab_size,
            self.max_model_len,
            has_tokenizer=self.tokenizer is not None,
        )
        limit = self.max_whole_image_tokens
        for feature in processed.features if processed and limit else ():
            if feature.placeholder.length > limit:
                raise ValueError(
                    f"an image of {feature.placeholder.length} tokens is more than a step's "
                    f"max_num_batched_tokens ({limit}), and this model computes each image's "
                    "tokens in one step; raise max_num_batched_tokens"
                )
        if processed is not None and len(prompt_token_ids) != num_tokens:
            raise ValueError(
                "truncate_prompt_tokens would cut a prompt with images; it is refused for "
                "prompts with images"
            )
        params.verify_for_model(vocab_size, self.max_logprobs)
        eos_ids = self.eos_token_ids
        extra_eos = [i for i in eos_ids[1:] if i not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            # The other EOS ids stop the request like the first (and min_tokens holds them back).
            params = dataclasses.replace(
                params, stop_token_ids=[*params.stop_token_ids, *extra_eos]
            )
        grammar = None  # the compiled constraint, shared by the n samples
        if params.structured_outputs is not None:
            grammar = self.structured_outputs.compile(params.structured_outputs)
        bad_words = []
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer; this model ships none")
            bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        parent = None if params.n == 1 else ParentRequest(request_id, params)
        taken = [c for c in parent.child_ids if is_in_use(c)] if parent else []
        if taken:
            raise ValueError(
                f"request_id {request_id!r} with n={params.n} needs the ids {taken}, "
                "which are already in use"
            )
        children = (
            [(request_id, params)]
            if parent is None
            else [(cid, child_params(params, i)) for i, cid in enumerate(parent.child_ids)]
        )
        metrics = RequestMetrics(arrival_time=arrival_time)  # the n samples share milestones
        requests = []
        for child_id, child in children:
            seed = child.seed if child.seed is not None else int(self._seed_rng.integers(2**31))
            request = Request(
                request_id=child_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=child,
                eos_token_id=eos_ids[0] if eos_ids else None,
                arrival_time=arrival_time,
                prompt=prompt_text,
                seed=seed,
                cache_salt=prompt_cache_salt(prompt),
                priority=priority,
                lora_request=lora_request,
                mm_features=processed.features if processed else None,
            )
            if processed is not None and processed.rope_positions is not None:
                request.rope_positions = processed.rope_positions
                request.rope_delta = processed.rope_delta
            request.bad_words_token_ids = bad_words
            if grammar is not None:
                request.structured_output = GrammarState(grammar)
            request.metrics = metrics
            requests.append(request)
        return parent, requests
