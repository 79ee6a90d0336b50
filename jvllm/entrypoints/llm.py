"""`LLM`: vLLM's offline API. Add every prompt, step the engine until all finish, return in order."""

import dataclasses
import threading
from collections.abc import Sequence

from tqdm.auto import tqdm

from jvllm.core.request import RequestStatus
from jvllm.engine.data_parallel import make_engine, replicas
from jvllm.engine.input_processor import PromptType, check_no_lora
from jvllm.engine.sleep import check_replicas_idle
from jvllm.entrypoints.beam_search import beam_search
from jvllm.entrypoints.chat import as_conversations, chat_images, render_conversation
from jvllm.entrypoints.score_utils import cosine_scores, score_sides
from jvllm.lora.request import LoRARequest
from jvllm.outputs import BeamSearchOutput, RequestOutput
from jvllm.pooling_outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """An offline engine: `LLM()` loads the default model (SmolLM2-135M-Instruct).

    Keyword arguments are `EngineArgs` fields (dtype, max_model_len, block_size,
    kv_cache_memory_bytes, max_num_seqs, attention_backend, ...).

    Calls from several threads run one at a time, each with its own correct outputs; to serve
    concurrent callers in shared steps, use `jvllm.engine.async_llm.AsyncLLM`.
    """

    def __init__(self, model: str | None = None, **kwargs):
        # data_parallel_size > 1: replicas behind one front end (engine/data_parallel.py).
        self.llm_engine = make_engine(model, **kwargs)
        self._request_counter = 0
        # One generate at a time steps the engine: two would step each other's requests and
        # donate the same KV cache. (chat and beam_search go through generate.)
        self._lock = threading.Lock()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling_params: SamplingParams() with the
        defaults of the model's generation_config.json (see EngineArgs.generation_config)."""
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's); False while requests hold blocks."""
        with self._lock:
            reset = [e.reset_prefix_cache() for e in replicas(self.llm_engine)]  # every one
            return all(reset)

    def sleep(self, level: int = 1) -> None:
        """Free the device between RL steps (vLLM's; needs enable_sleep_mode=True): level 1
        moves the weights to host memory and discards the KV cache, level 2 discards both
        (load_weights brings weights back). Generating raises until wake_up()."""
        with self._lock:
            engines = replicas(self.llm_engine)
            check_replicas_idle(engines, "sleep")
            for engine in engines:
                engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep freed: `tags` among "weights" and "kv_cache" (None: both)."""
        with self._lock:
            for engine in replicas(self.llm_engine):
                engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return any(e.is_sleeping() for e in replicas(self.llm_engine))

    def load_weights(self, weights) -> set[str]:
        """Replace the weights with (HF tensor name, array) pairs, as vLLM's model.load_weights
        takes them (e.g. a trained model's state_dict().items(); a subset is fine, but each
        param's tensors together); resets the prefix cache. -> the params replaced."""
        with self._lock:
            check_replicas_idle(replicas(self.llm_engine), "load_weights")
            return self.llm_engine.load_weights(weights)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in the order of `prompts`.
        `lora_request` (vLLM's): the LoRARequest every prompt runs with, or one a prompt (None
        for the base model); the engine needs enable_lora=True. `priority` (vLLM's): one int a
        prompt, lower first, under scheduling_policy="priority" (None: all 0)."""
        self._check_runner("generate", "generate")
        prompts = _as_prompt_list(prompts)
        if priority is None:
            priority = [0] * len(prompts)
        if not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ValueError(
                f"priority must be a list with one int a prompt ({len(prompts)}), got {priority!r}"
            )
        adapters = _per_prompt(lora_request, len(prompts))
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm, list(priority), adapters)

    def _generate(
        self, prompts, sampling_params, use_tqdm: bool, priorities: list[int], adapters=None
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                    "pass one SamplingParams or one per prompt"
                )
        # Only final outputs are collected (vLLM does the same); the caller's objects stay as given.
        params_list = [
            p
            if not isinstance(p, SamplingParams) or p.output_kind == RequestOutputKind.FINAL_ONLY
            else dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            for p in params_list
        ]
        request_ids = self._add_requests(prompts, params_list, priorities, adapters)
        return self._run_engine(request_ids, use_tqdm)

    def _add_requests(
        self, prompts, params_list, priorities: list[int], adapters=None
    ) -> list[str]:
        """Add every prompt's request, or none: a bad prompt aborts those added before it.
        `adapters`: one LoRARequest or None a prompt (None: the base model for all)."""
        engine = self.llm_engine
        request_ids = []
        adapters = adapters or [None] * len(prompts)
        try:
            for prompt, params, priority, adapter in zip(
                prompts, params_list, priorities, adapters
            ):
                request_id = str(self._request_counter)
                engine.add_request(
                    request_id, prompt, params, priority=priority, lora_request=adapter
                )
                self._request_counter += 1
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)  # a bad prompt leaves nothing behind
            raise
        return request_ids

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list
        of conversations, rendered through the tokenizer's chat template (or `chat_template`).
        `tools`: OpenAI-style function definitions, written into the prompt by the template;
        the replies are text (constrain them with `structured_outputs` to force a call).
        `chat_template_kwargs`: more variables for the template (e.g. a model's thinking
        switch). `lora_request`: as generate's."""
        self._check_runner("generate", "chat")
        tokenizer = self.get_tokenizer()
        images = chat_images(self.llm_engine)
        prompts = [
            render_conversation(
                tokenizer,
                conversation,
                chat_template,
                add_generation_prompt,
                continue_final_message,
                chat_template_kwargs,
                tools=tools,
                images=images,
            )
            for conversation in as_conversations(messages)
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        lora_request=None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the `beam_width` best sequences of each prompt, searched
        `concurrency_limit` prompts at a time (None: all at once); `lora_request`: one
        LoRARequest for every prompt, or None."""
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest or None in beam_search, got {lora_request!r}"
            )
        self._check_runner("generate", "beam_search")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        return beam_search(self, prompts, params, use_tqdm, concurrency_limit, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request=None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (runner="pooling"): the model's final hidden
        states pooled as the engine's PoolerConfig says, cut to `dimensions` and normalized as
        each PoolingParams says. `truncate_prompt_tokens` (vLLM's): embed the last k tokens."""
        check_no_lora(lora_request)
        outputs = self._pool("embed", prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        pooling_task: str = "embed",
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's pooling call: one `PoolingRequestOutput` per prompt (`.outputs.data`, a
        NumPy array); `pooling_task` "embed" only."""
        check_no_lora(lora_request)
        if pooling_task != "embed":
            raise ValueError(f"pooling_task must be 'embed', got {pooling_task!r}")
        return self._pool("encode", prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request=None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's score for an embedding model (runner="pooling"): the cosine similarity of
        text_1's and text_2's embeddings, 1:1, 1:N (text_1 one text) or N:N (pairwise), one
        output per text of text_2. Each text is embedded once."""
        check_no_lora(lora_request)
        texts_1, texts_2 = score_sides(text_1, text_2)
        embeds = self._pool(
            "score", [*texts_1, *texts_2], pooling_params, use_tqdm, truncate_prompt_tokens
        )
        tokenizer = self.get_tokenizer()
        pad_token_id = None if tokenizer is None else tokenizer.pad_token_id
        return cosine_scores(embeds[: len(texts_1)], embeds[len(texts_1) :], pad_token_id)

    def _pool(
        self, call: str, prompts, pooling_params, use_tqdm: bool, truncate_prompt_tokens
    ) -> list[PoolingRequestOutput]:
        self._check_runner("pooling", call)
        prompts = _as_prompt_list(prompts)
        params_list = _pooling_params_list(pooling_params, len(prompts), truncate_prompt_tokens)
        with self._lock:
            request_ids = self._add_requests(prompts, params_list, [0] * len(prompts))
            outputs = self._run_engine(request_ids, use_tqdm)
        for output in outputs:
            if output.outputs is None:
                raise RuntimeError(f"request {output.request_id} finished without an embedding")
        return outputs

    def _check_runner(self, runner: str, call: str) -> None:
        """A ValueError when `call` needs the other runner than this engine's."""
        own = self.llm_engine.engine_config.load_config.runner
        if own != runner:
            raise ValueError(
                f"LLM.{call} needs runner={runner!r}; this LLM was started with runner={own!r}: "
                f"create it with LLM(model, runner={runner!r})"
            )

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        num_output_tokens = 0
        runners = [replica.model_runner for replica in replicas(engine)]
        # Replicas step side by side: the longest of their waits is what delayed the outputs.
        compile_wait = lambda: max(r.compiler.compile_wait_seconds for r in runners)
        compile_wait_start = compile_wait()
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                _raise_on_failure(engine.last_finished_requests)
                for output in outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        if isinstance(output, RequestOutput):
                            num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        progress.update(1)
                        # The rate leaves out the time steps waited for compiles.
                        compiling = compile_wait() - compile_wait_start
                        elapsed = max(progress.format_dict["elapsed"] - compiling, 1e-9)
                        progress.set_postfix_str(f"output: {num_output_tokens / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request([i for i in request_ids if i not in finished])
            raise
        finally:
            progress.close()
        return [finished[i] for i in request_ids]


def _raise_on_failure(finished_requests) -> None:
    """A request the engine aborted for a failure (its step, its output, its grammar) fails the
    call, as in vLLM, rather than coming back cut short with finish_reason "abort"."""
    for request in finished_requests:
        if request.status == RequestStatus.FINISHED_ABORTED and request.status_message:
            raise RuntimeError(f"request {request.request_id} failed: {request.status_message}")


def _per_prompt(lora_request, num_prompts: int) -> list | None:
    """generate's `lora_request` as one LoRARequest or None a prompt; None for no adapters."""
    if lora_request is None:
        return None
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    adapters = list(lora_request) if isinstance(lora_request, list | tuple) else None
    if adapters is None or len(adapters) != num_prompts:
        raise ValueError(
            "lora_request must be a LoRARequest, or a list with one (or None) a prompt "
            f"({num_prompts}), got {lora_request!r}"
        )
    return adapters


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _pooling_params_list(
    pooling_params, num_prompts: int, truncate_prompt_tokens: int | None
) -> list[PoolingParams]:
    """One PoolingParams a prompt, `truncate_prompt_tokens` set where given."""
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params_list = [pooling_params or PoolingParams()] * num_prompts
    else:
        params_list = list(pooling_params)
        if len(params_list) != num_prompts:
            raise ValueError(
                f"got {len(params_list)} pooling_params for {num_prompts} prompts; "
                "pass one PoolingParams or one per prompt"
            )
    if truncate_prompt_tokens is not None:
        params_list = [
            dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
            for p in params_list
        ]
    return params_list
