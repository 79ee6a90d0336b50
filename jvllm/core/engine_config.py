"""The engine's configuration, built once from the user's options (vLLM's `VllmConfig`):
`EngineArgs.create_engine_config()` checks every option and every refusal between options, and
returns one frozen `EngineConfig`. Each component receives its own group, never the options.

A new engine option touches its EngineArgs field, the group it lands in (here, and the line of
`create_engine_config` that fills it) and the code that reads it.

jvllm's `ModelConfig` (jvllm/config.py) is the loaded model's architecture, what vLLM keeps in
`model_config.hf_config`; which model to load and how is `LoadConfig` here (vLLM's
ModelConfig and LoadConfig)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_groups import KVCacheGroups, kv_cache_groups
from jvllm.pooler_config import PoolerConfig
from jvllm.spec_decode.config import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """Which model, its tokenizer and generation defaults, and how its weights load."""

    model: str | None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer: str | None
    skip_tokenizer_init: bool
    dtype: str  # "auto", "float32" or "bfloat16"
    quantization: str | None
    load_format: str
    hf_overrides: Mapping[str, Any] | Callable | None
    # The longest sequence: the user's, until the worker resolves it against the model.
    max_model_len: int | None
    generation_config: str
    override_generation_config: dict | None
    runner: str  # "generate" or "pooling"
    seed: int
    max_logprobs: int
    logprobs_mode: str
    enable_sleep_mode: bool


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: its blocks, what they store, how many, and the prefix cache."""

    block_size: int
    kv_cache_dtype: str
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    # vLLM's: True keeps every page of a windowed layer, as a full-attention one's.
    disable_hybrid_kv_cache_manager: bool
    # The layers' groups (core/kv_groups.py); None until the worker has loaded the model.
    kv_groups: KVCacheGroups | None = None


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The ("data", "model") mesh and, over several hosts, jax.distributed's coordinates."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None  # the replica one LLMEngine runs; None when D = 1
    # A mixture of experts' routed experts placed whole over the T devices (E/T each) instead
    # of each cut on its F (distributed/expert_parallel.py).
    enable_expert_parallel: bool = False
    # With data_parallel_size > 1 and enable_expert_parallel, how the ranks' MoE layers move
    # tokens to their experts' devices: one of config.py's ALL2ALL_BACKENDS.
    all2all_backend: str = "auto"
    distributed_coordinator_address: str | None = None
    distributed_num_processes: int | None = None
    distributed_process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Adapter slots (enable_lora): max_loras on the device of rank up to max_lora_rank, and
    max_cpu_loras adapters kept read on the host."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """What the model runner compiles and runs (worker/model_runner.py). Its limits are the
    scheduler's own values, copied by `create_engine_config`, so that the two cannot differ."""

    block_size: int
    max_model_len: int | None  # resolved with the model, as LoadConfig's
    max_num_batched_tokens: int
    max_num_seqs: int
    attention_backend: str | None  # None: the device's default, until the worker resolves it
    kv_cache_dtype: str
    max_logprobs: int
    logprobs_mode: str
    num_scheduler_steps: int
    async_scheduling: bool
    num_speculative_tokens: int  # 0: no speculation
    pooling_type: str | None  # a pooling runner's (PoolerConfig's); None: it generates
    max_cpu_loras: int  # 0: no adapters
    compile_all_buckets: bool
    compile_in_background: bool
    # "ngram" drafts' (prompt_lookup_min, prompt_lookup_max): a window of speculative rounds
    # looks them up on the device (spec_decode/ngram_device.py); None: a draft model or head
    # proposes them, or no speculation.
    prompt_lookup: tuple[int, int] | None = None

    @property
    def reads_token_history(self) -> bool:
        """Whether windows of speculative rounds look n-gram drafts up over each request's
        tokens in the token cache, read through its first KV group's table: that table must
        then hold every block (core/kv_groups.py)."""
        return self.prompt_lookup is not None and self.num_scheduler_steps > 1


@dataclasses.dataclass(frozen=True)
class MultiModalConfig:
    """Images in prompts (vLLM's names): how many a prompt may hold (limit_mm_per_prompt,
    {"image": k}; None: any number), the model processor's settings for every prompt
    (mm_processor_kwargs), and where chat `image_url` parts may point: `file://` only under
    allowed_local_media_path, http(s) only to allowed_media_domains (None: any host)."""

    limit_mm_per_prompt: Mapping[str, int] | None = None
    mm_processor_kwargs: Mapping[str, Any] | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    load_config: LoadConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    runner_config: RunnerConfig
    lora_config: LoRAConfig | None = None  # None: no adapters
    speculative_config: SpeculativeConfig | None = None  # None: no speculation
    pooler_config: PoolerConfig | None = None  # a pooling runner's, resolved; None: generates
    multimodal_config: MultiModalConfig = MultiModalConfig()

    @property
    def max_model_len(self) -> int | None:
        return self.load_config.max_model_len

    def resolved(
        self,
        max_model_len: int,
        attention_backend: str,
        max_image_tokens: int = 0,
        keep_images_whole: bool = False,
        layer_windows: tuple[int | None, ...] = (),
    ) -> EngineConfig:
        """This config once the worker has loaded the model (its longest sequence known; the
        scheduler's checks run again on it) and found its devices (the attention backend
        where the user named none). `max_image_tokens` > 0: the model takes images of up to
        that many embeddings, and the encoder's budget and cache are vLLM's defaults, the step's
        token budget, or one image where that is more; `keep_images_whole`: the model's image
        tokens attend to their whole image, so no step ends inside one. `layer_windows`: each
        layer's sliding window (None: global), which the KV cache's groups follow."""
        replace = dataclasses.replace
        threshold = self.scheduler_config.long_prefill_token_threshold
        if keep_images_whole and 0 < threshold < max_image_tokens:
            raise ValueError(
                f"long_prefill_token_threshold={threshold} is less than this model's images "
                f"({max_image_tokens} tokens), which it computes in one step each; raise it to "
                f"at least {max_image_tokens}, or 0 (off)"
            )
        encoder = 0
        if max_image_tokens:
            encoder = max(self.scheduler_config.max_num_batched_tokens, max_image_tokens)
        return replace(
            self,
            load_config=replace(self.load_config, max_model_len=max_model_len),
            cache_config=replace(
                self.cache_config,
                kv_groups=kv_cache_groups(
                    layer_windows,
                    not self.cache_config.disable_hybrid_kv_cache_manager,
                    self.runner_config.reads_token_history,
                ),
            ),
            scheduler_config=replace(
                self.scheduler_config,
                max_model_len=max_model_len,
                max_num_encoder_input_tokens=encoder,
                encoder_cache_size=encoder,
                keep_images_whole=keep_images_whole,
            ),
            runner_config=replace(
                self.runner_config,
                max_model_len=max_model_len,
                attention_backend=attention_backend,
            ),
        )
