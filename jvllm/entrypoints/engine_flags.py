"""The engine's options as command-line flags (vLLM's names): the EngineArgs fields a command
exposes, each with its type or choices and a help line, and the keywords the parsed flags give
EngineArgs."""

from __future__ import annotations

import argparse
import dataclasses
import json

from jvllm.attention.kv_quant import KV_CACHE_DTYPES
from jvllm.config import ALL2ALL_BACKENDS, DTYPE_CHOICES, LOGPROBS_MODES
from jvllm.core.block_hash import PREFIX_CACHING_HASH_ALGOS
from jvllm.core.config import SCHEDULING_POLICIES
from jvllm.engine.arg_utils import RUNNERS, EngineArgs, normalize_dtype
from jvllm.model_loader.loader import LOAD_FORMATS
from jvllm.quantization import QUANTIZATION_METHODS


def _dtype(value: str) -> str:
    """--dtype as EngineArgs takes it; argparse shows normalize_dtype's message."""
    try:
        return normalize_dtype(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(value: str) -> dict:
    """--hf-overrides: a JSON object."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return parsed


# EngineArgs fields exposed as flags (vLLM's flag names); --help shows each one's default.
_ENGINE_FLAGS = {
    "dtype": {
        "type": _dtype,
        "help": f"weights' and activations' dtype: {', '.join(DTYPE_CHOICES)} ('float': float32)",
    },
    "load_format": {"choices": list(LOAD_FORMATS), "help": "dummy: random weights (benchmarks)"},
    "tokenizer": {"help": "a directory with tokenizer files or a .gguf file (None: the model's)"},
    "skip_tokenizer_init": {
        "action": argparse.BooleanOptionalAction,
        "help": "no tokenizer: prompts as token ids, outputs without text",
    },
    "quantization": {
        "choices": list(QUANTIZATION_METHODS),
        "help": "weights kept quantized (None: gguf for a .gguf file, else the model dtype)",
    },
    "hf_overrides": {
        "type": _json_object,
        "help": "config.json keys to replace, as JSON, e.g. '{\"rope_scaling\": {...}}'",
    },
    "max_model_len": {"type": int, "help": "longest prompt + output (None: the model's)"},
    "max_logprobs": {"type": int, "help": "most logprobs a request may ask for"},
    "logprobs_mode": {
        "choices": list(LOGPROBS_MODES),
        "help": "raw: of the model's logits; processed: of what the sampler drew from",
    },
    "trust_remote_code": {
        "action": "store_true",
        "help": "accepted for vLLM's scripts: jvllm runs no code from model directories",
    },
    "enforce_eager": {
        "action": "store_true",
        "help": "accepted for vLLM's scripts: jvllm's steps are always compiled",
    },
    # Taken at the values that say what jvllm does (engine/vllm_options.py).
    "tokenizer_mode": {"help": "auto or hf: the Hugging Face tokenizer"},
    "revision": {"help": "accepted unset: local files only"},
    "download_dir": {"help": "accepted unset: local files only"},
    "swap_space": {"type": float, "help": "accepted: preempted requests are recomputed"},
    "cpu_offload_gb": {"type": float, "help": "accepted at 0: the weights stay on the device"},
    "pipeline_parallel_size": {"type": int, "help": "accepted at 1: use --tensor-parallel-size"},
    "distributed_executor_backend": {"help": "accepted unset, mp or uni"},
    "override_generation_config": {
        "type": _json_object,
        "help": "generation_config.json sampling fields to set, as JSON, e.g. "
        "'{\"temperature\": 0.6}'",
    },
    "max_num_seqs": {"type": int, "help": "most requests in one step"},
    "max_num_batched_tokens": {"type": int, "help": "most tokens in one step"},
    "block_size": {"type": int, "help": "tokens per KV cache block"},
    "kv_cache_memory_bytes": {"type": int, "help": "KV cache size in bytes"},
    "kv_cache_dtype": {
        "choices": list(KV_CACHE_DTYPES),
        "help": "auto: the model's dtype; fp8, int8: 1 byte a value with per-token scales",
    },
    "num_gpu_blocks_override": {"type": int, "help": "KV cache size in blocks (wins)"},
    "gpu_memory_utilization": {"type": float, "help": "share of device memory to use"},
    "long_prefill_token_threshold": {"type": int, "help": "prefill chunk cap per request (0: off)"},
    "attention_backend": {"help": "None: pallas on GPU, reference elsewhere"},
    "seed": {"type": int, "help": "seed of the seeds of requests that set none"},
    "generation_config": {"help": "auto: the model's generation_config.json; vllm: ignore it"},
    "enable_prefix_caching": {"action": argparse.BooleanOptionalAction, "help": "reuse KV blocks"},
    "disable_hybrid_kv_cache_manager": {
        "action": "store_true",
        "help": "keep every KV page of sliding-window layers",
    },
    "prefix_caching_hash_algo": {
        "choices": list(PREFIX_CACHING_HASH_ALGOS),
        "help": "block hash of the prefix cache; builtin: fastest, not collision-resistant",
    },
    "enable_chunked_prefill": {
        "action": argparse.BooleanOptionalAction,
        "help": "split long prompts over steps",
    },
    "num_scheduler_steps": {"type": int, "help": "decode steps per device call"},
    "scheduling_policy": {
        "choices": list(SCHEDULING_POLICIES),
        "help": "priority: requests' priority (lowest first), then arrival",
    },
    "async_scheduling": {
        "action": argparse.BooleanOptionalAction,
        "help": "overlap the host's work with the next step",
    },
    "runner": {"choices": list(RUNNERS), "help": "pooling: an embedding model (/v1/embeddings)"},
    "task": {"help": "vLLM's older name: embed = --runner pooling"},
    "pooler_config": {
        "type": _json_object,
        "help": 'pooling of --runner pooling, e.g. \'{"pooling_type": "MEAN", "normalize": true}\'',
    },
    "speculative_config": {
        "type": _json_object,
        "help": 'n-gram speculative decoding, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\'',
    },
    "enable_lora": {"action": "store_true", "help": "serve LoRA adapters (--lora-modules)"},
    "max_loras": {"type": int, "help": "most LoRA adapters in one step"},
    "max_lora_rank": {"type": int, "help": "largest LoRA rank served"},
    "max_cpu_loras": {"type": int, "help": "LoRA adapters kept read in memory (None: max-loras)"},
    "limit_mm_per_prompt": {
        "type": _json_object,
        "help": "most images a prompt may hold, e.g. '{\"image\": 2}' (None: any number)",
    },
    "mm_processor_kwargs": {
        "type": _json_object,
        "help": "the model's HF processor settings for every prompt, as JSON",
    },
    "allowed_local_media_path": {
        "help": "file:// image URLs are read only under this folder (None: refused)",
    },
    "allowed_media_domains": {
        "nargs": "+",
        "help": "http(s) image URLs only from these hosts (None: any host)",
    },
    "tensor_parallel_size": {"type": int, "help": "devices each replica is cut over"},
    "data_parallel_size": {"type": int, "help": "replicas"},
    "enable_expert_parallel": {
        "action": "store_true",
        "help": "place MoE experts whole over the devices (E / tensor-parallel-size each)",
    },
    "all2all_backend": {
        "choices": list(ALL2ALL_BACKENDS),
        "help": "how data-parallel ranks' MoE layers send tokens to their experts' devices",
    },
    "distributed_coordinator_address": {"help": "host:port of process 0 (several hosts)"},
    "distributed_num_processes": {"type": int, "help": "processes (hosts) in all"},
    "distributed_process_id": {"type": int, "help": "this process's rank"},
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    for name, kwargs in _ENGINE_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", default=getattr(defaults, name), **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict:
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    return {name: getattr(args, name) for name in _ENGINE_FLAGS if name in fields}
