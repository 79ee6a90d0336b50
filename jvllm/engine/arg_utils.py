"""Engine options (vLLM's names), validated on construction."""

import dataclasses
from collections.abc import Mapping

from jvllm.attention.backends import ATTENTION_BACKENDS
from jvllm.attention.kv_quant import KV_CACHE_DTYPES
from jvllm.config import DTYPE_CHOICES, LOGPROBS_MODES
from jvllm.core.block_hash import PREFIX_CACHING_HASH_ALGOS
from jvllm.core.config import SCHEDULING_POLICIES
from jvllm.engine.vllm_options import NEUTRAL_OPTIONS, check_neutral_options
from jvllm.lora.config import check_lora_args
from jvllm.model_loader.generation_config import check_generation_overrides
from jvllm.model_loader.hf import HFOverrides
from jvllm.model_loader.loader import LOAD_FORMATS, check_tokenizer_path
from jvllm.pooler_config import PoolerConfig, as_pooler_config
from jvllm.quantization import QUANTIZATION_METHODS
from jvllm.spec_decode.config import (
    SpeculativeConfig,
    as_speculative_config,
    check_speculation_args,
)


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
    # The KV cache's size (engine/kv_budget.py): num_gpu_blocks_override, an exact block count
    # (null block included); else kv_cache_memory_bytes; else gpu_memory_utilization of the
    # device's memory less the weights and activations (on CPU: up to 1 GiB of free memory).
    kv_cache_memory_bytes: int | None = None
    # What the cache stores (vLLM's names): "auto", the model's dtype; "fp8" (= "fp8_e4m3") or
    # "int8", one byte a value with a scale per token and KV head (attention/kv_quant.py):
    # about twice the blocks of a bfloat16 cache in the same memory.
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # How full blocks are hashed for the prefix cache (core/block_hash.py): "sha256",
    # "sha256_cbor" (the same, over a portable serialization), or "builtin" (Python's hash():
    # fastest, not collision-resistant; the pool's exact comparison still keeps hits correct).
    prefix_caching_hash_algo: str = "sha256"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
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
    # "prompt_lookup_min": 1} drafts greedy requests' next k tokens from their own earlier
    # tokens and verifies them in one step (core/spec_decode.py); None: no speculation.
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self):
        self.dtype = normalize_dtype(self.dtype)
        self.runner = resolve_runner(self.runner, self.task)
        self._check_pooling()
        self.speculative_config = as_speculative_config(self.speculative_config)
        check_speculation_args(self)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be None or one of {QUANTIZATION_METHODS}, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization == "gguf" and self.load_format == "dummy":
            raise ValueError(
                "quantization='gguf' keeps a GGUF file's blocks packed; load_format='dummy' "
                "draws float weights of the model's shapes: use one or the other"
            )
        if self.quantization in ("int8", "fp8") and self.tensor_parallel_size > 1:
            raise ValueError(
                f"quantization={self.quantization!r} runs on one device; tensor_parallel_size="
                f"{self.tensor_parallel_size} is not supported with it yet"
            )
        _positive("block_size", self.block_size)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("num_scheduler_steps", self.num_scheduler_steps)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        rank = self.data_parallel_rank
        if rank is not None and (
            not isinstance(rank, int)
            or isinstance(rank, bool)
            or not 0 <= rank < self.data_parallel_size
        ):
            raise ValueError(
                f"data_parallel_rank must be an int in [0, data_parallel_size={self.data_parallel_size}), "
                f"got {rank!r}"
            )
        if self.tokenizer is not None:
            check_tokenizer_path(self.tokenizer)
        _check_hf_overrides(self.hf_overrides)
        for name in (
            "async_scheduling",
            "compile_all_buckets",
            "compile_in_background",
            "skip_tokenizer_init",
            "enable_sleep_mode",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(  # noqa: TRY004 - every bad engine option is a ValueError (vLLM)
                    f"{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        utilization = self.gpu_memory_utilization
        if (
            isinstance(utilization, bool)
            or not isinstance(utilization, int | float)
            or not 0 < utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be a float in (0, 1], got {utilization!r}"
            )
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 2
        ):
            raise ValueError(
                "num_gpu_blocks_override must be an int >= 2 (block 0 is the reserved null "
                f"block), got {self.num_gpu_blocks_override!r}"
            )
        check_neutral_options({name: getattr(self, name) for name in NEUTRAL_OPTIONS})
        check_lora_args(self)
        check_generation_overrides(self.override_generation_config)
        for name in ("trust_remote_code", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = off), "
                f"got {self.long_prefill_token_threshold}"
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a directory holding "
                f"generation_config.json, got {self.generation_config!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {PREFIX_CACHING_HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

    def _check_pooling(self) -> None:
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config is for runner='pooling'; this engine generates")
            return
        self.pooler_config = as_pooler_config(self.pooler_config)
        if self.num_scheduler_steps != 1 or self.async_scheduling:
            raise ValueError(
                "runner='pooling' computes prompts only: num_scheduler_steps must be 1 and "
                "async_scheduling False (they run decode steps ahead)"
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


def _check_hf_overrides(overrides) -> None:
    if overrides is None or callable(overrides):
        return
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
        raise ValueError(
            "hf_overrides must be a dict of config.json keys to their values (e.g. "
            '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
            '"original_max_position_embeddings": 32768}}) or a function of the config dict, '
            f"got {overrides!r}"
        )


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
