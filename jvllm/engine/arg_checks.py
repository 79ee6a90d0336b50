"""Every refusal of the engine's options, one field's and between fields', in the one step
that makes the engine's config, before anything loads (EngineArgs runs it on construction,
and create_engine_config again). Messages name the option, its value and what is allowed.

The scheduler's limits (max_num_batched_tokens, max_num_seqs, num_scheduler_steps, chunked
prefill, the policy, max_model_len) are SchedulerConfig's to check, made in that step between
`check_fields` and `check_combinations`, so that each check is written once; what only the
loaded model tells (max_model_len where none is given) is checked once the worker knows it.
"""

import os
from collections.abc import Mapping

from jvllm.attention.backends import ATTENTION_BACKENDS
from jvllm.attention.kv_quant import KV_CACHE_DTYPES
from jvllm.config import ALL2ALL_BACKENDS, LOGPROBS_MODES
from jvllm.core.block_hash import PREFIX_CACHING_HASH_ALGOS
from jvllm.core.checks import check_bool, check_choice, check_int
from jvllm.engine.vllm_options import NEUTRAL_OPTIONS, check_neutral_options
from jvllm.model_loader.generation_config import check_generation_overrides
from jvllm.model_loader.loader import LOAD_FORMATS, check_tokenizer_path
from jvllm.quantization import QUANTIZATION_METHODS

_BOOLS = (
    "async_scheduling",
    "compile_all_buckets",
    "compile_in_background",
    "skip_tokenizer_init",
    "enable_sleep_mode",
    "enable_prefix_caching",
    "disable_hybrid_kv_cache_manager",
    "enable_lora",
    "enable_expert_parallel",
)
_POSITIVE_INTS = (
    "block_size",
    "tensor_parallel_size",
    "data_parallel_size",
    "max_loras",
    "max_lora_rank",
)


def check_fields(args) -> None:
    """ValueError (TypeError for vLLM's no-op bools) naming the first option of `args` (an
    EngineArgs, its dtype, runner and speculative_config already normalized) that jvllm
    cannot take, the scheduler's limits aside."""
    for name in _BOOLS:
        check_bool(name, getattr(args, name))
    for name in _POSITIVE_INTS:
        check_int(name, getattr(args, name))
    check_int("kv_cache_memory_bytes", args.kv_cache_memory_bytes, optional=True)
    check_int("max_cpu_loras", args.max_cpu_loras, args.max_loras, optional=True, why="max_loras")
    check_int("max_logprobs", args.max_logprobs, 0)
    check_int(
        "num_gpu_blocks_override",
        args.num_gpu_blocks_override,
        2,
        optional=True,
        why="block 0 is the reserved null block",
    )
    check_choice("quantization", args.quantization, QUANTIZATION_METHODS, optional=True)
    check_choice("kv_cache_dtype", args.kv_cache_dtype, KV_CACHE_DTYPES)
    check_choice("load_format", args.load_format, LOAD_FORMATS)
    check_choice("logprobs_mode", args.logprobs_mode, LOGPROBS_MODES)
    check_choice(
        "prefix_caching_hash_algo", args.prefix_caching_hash_algo, PREFIX_CACHING_HASH_ALGOS
    )
    check_choice("attention_backend", args.attention_backend, ATTENTION_BACKENDS, optional=True)
    check_choice("all2all_backend", args.all2all_backend, ALL2ALL_BACKENDS)
    check_multimodal_fields(args)
    utilization = args.gpu_memory_utilization
    if (
        isinstance(utilization, bool)
        or not isinstance(utilization, int | float)
        or not 0 < utilization <= 1
    ):
        raise ValueError(f"gpu_memory_utilization must be a float in (0, 1], got {utilization!r}")
    if not isinstance(args.generation_config, str) or not args.generation_config:
        raise ValueError(
            "generation_config must be 'auto', 'vllm' or a directory holding "
            f"generation_config.json, got {args.generation_config!r}"
        )
    if args.tokenizer is not None:
        check_tokenizer_path(args.tokenizer)
    _check_hf_overrides(args.hf_overrides)
    check_neutral_options({name: getattr(args, name) for name in NEUTRAL_OPTIONS})
    check_generation_overrides(args.override_generation_config)
    for name in ("trust_remote_code", "enforce_eager"):
        if not isinstance(getattr(args, name), bool):
            raise TypeError(f"{name} must be a bool, got {getattr(args, name)!r}")


def check_combinations(args) -> None:
    """ValueError for options that each are fine alone and not together (their fields and
    the scheduler's limits already checked)."""
    rank, size = args.data_parallel_rank, args.data_parallel_size
    if rank is not None and (
        not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size
    ):
        raise ValueError(
            f"data_parallel_rank must be an int in [0, data_parallel_size={size}), got {rank!r}"
        )
    if args.quantization == "gguf" and args.load_format == "dummy":
        raise ValueError(
            "quantization='gguf' keeps a GGUF file's blocks packed; load_format='dummy' "
            "draws float weights of the model's shapes: use one or the other"
        )
    if args.runner != "pooling" and args.pooler_config is not None:
        raise ValueError("pooler_config is for runner='pooling'; this engine generates")
    if args.runner == "pooling" and (args.num_scheduler_steps != 1 or args.async_scheduling):
        raise ValueError(
            "runner='pooling' computes prompts only: num_scheduler_steps must be 1 and "
            "async_scheduling False (they run decode steps ahead)"
        )
    if args.enable_lora and args.runner == "pooling":
        raise ValueError("enable_lora=True serves generating models; runner='pooling' is not")
    if args.speculative_config is not None:
        refused = {
            "async_scheduling=True": args.async_scheduling,
            "runner='pooling'": args.runner == "pooling",
        }
        found = [name for name, is_set in refused.items() if is_set]
        if found:
            raise ValueError(
                f"speculative_config does not run with {', '.join(found)}: verifying drafts "
                "needs the engine's own generation steps (async_scheduling=False, "
                "runner='generate')"
            )


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


# The modalities a prompt may name; only images are supported, the others only at 0.
MODALITIES = ("image", "video", "audio")


def check_multimodal_fields(args) -> None:
    """limit_mm_per_prompt, mm_processor_kwargs, allowed_local_media_path and
    allowed_media_domains as vLLM takes them."""
    limits = args.limit_mm_per_prompt
    if limits is not None:
        if not isinstance(limits, Mapping):
            raise TypeError(
                f'limit_mm_per_prompt must be a dict like {{"image": 2}}, got {limits!r}'
            )
        for modality, limit in limits.items():
            check_choice("limit_mm_per_prompt's modality", modality, MODALITIES)
            check_int(f"limit_mm_per_prompt[{modality!r}]", limit, 0)
            if modality != "image" and limit:
                raise ValueError(
                    f"limit_mm_per_prompt[{modality!r}]={limit}: only images are supported "
                    "(video and audio are not yet); allowed: 0"
                )
    kwargs = args.mm_processor_kwargs
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"mm_processor_kwargs must be a dict or None, got {kwargs!r}")
    domains = args.allowed_media_domains
    if domains is not None and (
        isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains)
    ):
        raise TypeError(
            f"allowed_media_domains must be a list of host names or None, got {domains!r}"
        )
    path = args.allowed_local_media_path
    if path is not None and (not isinstance(path, str) or not os.path.isdir(path)):
        raise ValueError(
            f"allowed_local_media_path={path!r} must be an existing directory (or None: "
            "file:// image URLs refused)"
        )
