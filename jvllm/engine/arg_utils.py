"""Engine options (vLLM's names): checked on construction (engine/arg_checks.py), and made
into the components' configs once by `create_engine_config` (core/engine_config.py)."""

import dataclasses

from jvllm.config import DTYPE_CHOICES
from jvllm.core.config import SchedulerConfig
from jvllm.core.engine_config import (
    CacheConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    MultiModalConfig,
    ParallelConfig,
    RunnerConfig,
)
from jvllm.engine.arg_checks import check_combinations, check_fields
from jvllm.model_loader.hf import HFOverrides
from jvllm.pooler_config import PoolerConfig, as_pooler_config, resolve_pooler_config
from jvllm.spec_decode.config import SpeculativeConfig, as_speculative_config


def normalize_dtype(dtype: str) -> str:
    """`dtype` as one of DTYPE_CHOICES, vLLM's "float" taken for float32; ValueError otherwise."""
    if dtype == "float":
        return "float32"
    if dtype in ("half", "float16"):
        raise ValueError(
            f"dtype {dtype!r} is not supported: jvllm computes in float32 or bfloat16 (a float16 "
            "checkpoint loads as float32 with dtype 'auto'); use 'bfloat16' or 'float32'"
        )
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES} (or 'float'), got {dtype!r}")
    return dtype


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None  # None = the default model (SmolLM2-135M-Instruct)
    # The tokenizer from elsewhere than the model: a local directory with tokenizer files, or a
    # .gguf file; None: the model's own. skip_tokenizer_init: none at all (prompts as token ids,
    # outputs without text).
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    # Weights kept quantized (jvllm/quantization/): "gguf" (a GGUF's blocks stay packed; the
    # default for a .gguf file with dtype "auto"), "int8" or "fp8" (per-channel scales, made at
    # load); None: the model dtype.
    quantization: str | None = None
    load_format: str = "auto"  # "dummy": random weights, only config.json read (benchmarks)
    # vLLM's: config.json keys to replace (e.g. {"rope_scaling": {"rope_type": "yarn", ...}}),
    # or a function of the config dict returning the one to use (model_loader/hf.py).
    hf_overrides: HFOverrides = None
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    block_size: int = 16
    # The KV cache's size (worker/kv_budget.py): num_gpu_blocks_override, an exact block count
    # (null block included); else kv_cache_memory_bytes; else gpu_memory_utilization of the
    # device's memory less the weights and activations (on CPU: up to 1 GiB of free memory).
    kv_cache_memory_bytes: int | None = None
    # What the cache stores (vLLM's names): "auto", the model's dtype; "fp8" (= "fp8_e4m3") or
    # "int8", one byte a value with a scale per token and KV head (attention/kv_quant.py):
    # about twice the blocks of a bfloat16 cache in the same memory.
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool | None = True  # None (vLLM's default): on
    # How full blocks are hashed for the prefix cache (core/block_hash.py): "sha256",
    # "sha256_cbor" (the same, over a portable serialization), or "builtin" (Python's hash():
    # fastest, not collision-resistant; the pool's exact comparison still keeps hits correct).
    prefix_caching_hash_algo: str = "sha256"
    # vLLM's: True keeps every KV page of a model's sliding-window layers, as without the
    # hybrid KV cache manager (core/kv_groups.py), which frees those their window passed.
    disable_hybrid_kv_cache_manager: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool | None = True  # None (vLLM's default): on
    attention_backend: str | None = None  # None = "pallas" on GPU, "reference" elsewhere
    seed: int = 0
    # False: each bucket compiles when a step first needs it (a few prompts wait for two or
    # three compiles, not all of them); True: every bucket at start-up, so that no step waits
    # on a compile. The server sets True.
    compile_all_buckets: bool = False
    # With compile_all_buckets: compile them in background threads, so that the engine serves
    # at once; a step whose bucket is not ready runs in a larger compiled one, or waits for its
    # own compile only. The server sets True.
    compile_in_background: bool = False
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES
    # vLLM's, taken so that its scripts run; they change nothing here: jvllm runs no code from
    # model directories (its families are built in), and its steps are always compiled.
    trust_remote_code: bool = False
    enforce_eager: bool = False
    # More of vLLM's, taken at the values that say what jvllm does (engine/vllm_options.py).
    tokenizer_mode: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    code_revision: str | None = None
    download_dir: str | None = None
    swap_space: float = 4
    cpu_offload_gb: float = 0
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    disable_log_stats: bool = True
    disable_custom_all_reduce: bool = False
    max_seq_len_to_capture: int = 8192
    compilation_config: int | dict | None = None
    served_model_name: str | list[str] | None = None
    # vLLM's: LLM.sleep() may free the weights and the KV cache between RL steps
    # (engine/sleep.py).
    enable_sleep_mode: bool = False
    # LoRA adapters (vLLM's names; jvllm/lora/): enable_lora gives the model max_loras adapter
    # slots of rank up to max_lora_rank; max_cpu_loras adapters stay read on the host (None:
    # max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Decode steps per device call while every running request decodes (vLLM's multi-step
    # scheduling; docs/design.md "Decode windows"); 1 = one step per call.
    num_scheduler_steps: int = 1
    # Dispatch the next decode step before reading this one's tokens, so that the host's work
    # overlaps the device's (vLLM v1's name; worker/async_step.py).
    async_scheduling: bool = False
    # "fcfs" or "priority" (vLLM's): which waiting request goes first, and which running one
    # gives its blocks back under memory pressure (core/scheduler.py).
    scheduling_policy: str = "fcfs"
    # "auto": the model directory's generation_config.json (EOS ids, sampling defaults);
    # "vllm": ignore it; or a directory holding one.
    generation_config: str = "auto"
    # vLLM's: generation_config.json sampling fields set over (or, with "vllm", instead of)
    # the model's, e.g. {"temperature": 0.6, "max_new_tokens": 512}.
    override_generation_config: dict | None = None
    # Scale-out over a ("data", "model") device mesh (jvllm/distributed/): each replica's
    # weights and KV cache cut over tensor_parallel_size devices; data_parallel_size replicas,
    # each with its own KV pool (LLM and the server run one per rank and share the requests).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None  # the replica an LLMEngine runs; None when D = 1
    # vLLM's: a mixture of experts' routed experts placed whole over the tensor_parallel_size
    # devices (E / T each, E a multiple of T) instead of each expert cut on its intermediate
    # size; a no-op for a model without experts or on one device.
    enable_expert_parallel: bool = False
    # vLLM's: with data_parallel_size > 1 and enable_expert_parallel, how the ranks' MoE layers
    # bring tokens to their experts' devices: "allgather_reducescatter" (every rank's tokens
    # to every device), "ragged_all_to_all" (each token to its experts' devices only), or
    # "auto": the all-to-all where it moves fewer bytes across hosts (docs/design.md, "MoE
    # layers across data-parallel ranks").
    all2all_backend: str = "auto"
    # Several processes (one per host) through jax.distributed; unset, the launcher's
    # JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (distributed/multihost.py).
    distributed_coordinator_address: str | None = None  # host:port of process 0
    distributed_num_processes: int | None = None
    distributed_process_id: int | None = None
    # vLLM's: "generate" (the default for "auto") samples tokens; "pooling" serves the model
    # as an embedding model (LLM.embed, /v1/embeddings; engine/pooling.py). vLLM's older
    # `task="embed"` means "pooling". pooler_config: how a pooling engine pools (a
    # PoolerConfig or a dict of its fields; None: the model directory's, else LAST, normalized).
    runner: str = "auto"
    task: str | None = None
    pooler_config: PoolerConfig | dict | None = None
    # vLLM's: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
    # "prompt_lookup_min": 1} drafts requests' next k tokens from their own earlier
    # tokens and verifies them in one step (core/spec_decode.py); None: no speculation.
    speculative_config: SpeculativeConfig | dict | None = None
    # Images (vLLM's names; core/engine_config.py's MultiModalConfig): {"image": k} caps a
    # prompt's images (None: no cap); the model processor's kwargs for every prompt; where
    # chat image_url parts may point (file:// under a folder, http(s) to some hosts).
    limit_mm_per_prompt: dict | None = None
    mm_processor_kwargs: dict | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None

    def __post_init__(self):
        self._normalize_and_check()

    def _normalize_and_check(self) -> SchedulerConfig:
        """vLLM's spellings and dicts as jvllm takes them, then every check (arg_checks.py,
        and the scheduler config's own); create_engine_config runs it again, for fields set
        after construction. -> the scheduler's config."""
        self.dtype = normalize_dtype(self.dtype)
        self.runner = resolve_runner(self.runner, self.task)
        if self.runner == "pooling":
            self.pooler_config = as_pooler_config(self.pooler_config)
        self.speculative_config = as_speculative_config(self.speculative_config)
        # vLLM's None: its default, on.
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if getattr(self, name) is None:
                setattr(self, name, True)
        check_fields(self)
        scheduler = SchedulerConfig(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            num_scheduler_steps=self.num_scheduler_steps,
            policy=self.scheduling_policy,
            max_loras=self.max_loras if self.enable_lora else 0,
        )
        check_combinations(self)
        return scheduler

    def _group(self, cls, **derived):
        """The config group `cls`, each field this EngineArgs' of the same name but those
        `derived` here."""
        names = [f.name for f in dataclasses.fields(cls) if f.name not in derived]
        return cls(**{name: getattr(self, name) for name in names}, **derived)

    def create_engine_config(self) -> EngineConfig:
        """Each component's config, once (vLLM's). What comes from the model directory's files
        alone (a pooling model's settings) is resolved here; what needs the loaded model or
        the devices (max_model_len, the attention backend), by the worker (Worker.config)."""
        scheduler = self._normalize_and_check()
        spec, lora, pooler = self.speculative_config, None, None
        if self.enable_lora:
            lora = LoRAConfig(
                self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras
            )
        if self.runner == "pooling":
            pooler = resolve_pooler_config(self.pooler_config, self.model)
        return EngineConfig(
            load_config=self._group(LoadConfig),
            cache_config=self._group(CacheConfig, kv_groups=None),
            scheduler_config=scheduler,
            parallel_config=self._group(ParallelConfig),
            runner_config=self._group(
                RunnerConfig,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                prompt_lookup=(
                    (spec.prompt_lookup_min, spec.prompt_lookup_max)
                    if spec and spec.method == "ngram"
                    else None
                ),
                pooling_type=pooler.pooling_type if pooler else None,
                max_cpu_loras=lora.max_cpu_loras if lora else 0,
            ),
            lora_config=lora,
            speculative_config=spec,
            pooler_config=pooler,
            multimodal_config=self._group(
                MultiModalConfig,
                allowed_media_domains=(
                    None
                    if self.allowed_media_domains is None
                    else tuple(self.allowed_media_domains)
                ),
            ),
        )


RUNNERS = ("auto", "generate", "pooling")
# vLLM's older `task` values, and the runner each one means.
TASK_RUNNERS = {"auto": None, "generate": "generate", "embed": "pooling", "embedding": "pooling"}


def resolve_runner(runner: str, task: str | None) -> str:
    """The runner, "generate" or "pooling", from vLLM's `runner` and its older `task`."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if task is not None and task not in TASK_RUNNERS:
        raise ValueError(f"task must be None or one of {tuple(TASK_RUNNERS)}, got {task!r}")
    implied = TASK_RUNNERS.get(task)
    if implied is not None and runner not in ("auto", implied):
        raise ValueError(f"task={task!r} needs runner={implied!r}, got runner={runner!r}")
    return implied or ("generate" if runner == "auto" else runner)
