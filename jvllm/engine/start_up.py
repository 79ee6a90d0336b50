"""Start-up: the native CPU kernels the engine will run, built while the model loads; the
scheduler and the model runner made from the engine's arguments; and compiling every bucket
(EngineArgs.compile_all_buckets), up front or in the background, saying so in the log."""

import time

from jax.sharding import Mesh

from jvllm.attention.backends import default_backend, prepare_backend
from jvllm.config import ModelConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.scheduler import Scheduler, SchedulerConfig
from jvllm.core.spec_decode import DraftProposer
from jvllm.engine.arg_utils import EngineArgs
from jvllm.layers import cpu_dense
from jvllm.logger import init_logger
from jvllm.lora.config import adapter_config
from jvllm.model_loader.loader import expected_dtype
from jvllm.worker.buckets import SPECULATIVE_MIN_TOKENS, BucketSpec
from jvllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


def build_kernels_early(args: EngineArgs) -> None:
    """Start building, in the background, the native kernels that the attention backend and the
    model dtype will use, so that tracing the first step finds them built."""
    backend = args.attention_backend or default_backend()
    prepare_backend(backend, args.kv_cache_dtype, args.block_size)
    cpu_dense.build_early(expected_dtype(args.model, args.dtype, args.hf_overrides))


def compile_up_front(
    runner: ModelRunner, in_background: bool, start: float, load_seconds: float
) -> None:
    """`start`: when the engine began loading (perf_counter). Several processes compile up
    front, in the same order, whatever `in_background` says (see Executables.lockstep)."""
    if in_background and not runner.lockstep:
        runner.compile_in_background()
        logger.info(
            "ready after %.1fs of loading; compiling %d executables in the background",
            load_seconds,
            len(runner.all_shapes()),
        )
        return
    compile_seconds = runner.compile_all()
    logger.info(
        "ready in %.1fs: load %.1fs, compile %.1fs (%d executables), warm-up %.1fs",
        time.perf_counter() - start,
        load_seconds,
        compile_seconds,
        runner.num_compilations,
        runner.warmup_seconds,
    )


def make_scheduler(
    args: EngineArgs, num_blocks: int, max_model_len: int, can_cache_prefix: bool
) -> Scheduler:
    """The engine's scheduler over a KV cache of `num_blocks`; `can_cache_prefix`: whether the
    engine's requests may reuse prefix-cache blocks at all (a pooling runner's may not all)."""
    spec = args.speculative_config
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_chunked_prefill=args.enable_chunked_prefill,
            num_scheduler_steps=args.num_scheduler_steps,
            policy=args.scheduling_policy,
            max_loras=args.max_loras if args.enable_lora else 0,
        ),
        KVCacheManager(
            num_blocks,
            args.block_size,
            args.enable_prefix_caching and can_cache_prefix,
            args.prefix_caching_hash_algo,
        ),
        spec and DraftProposer(spec, max_model_len),
    )


def make_runner(
    args: EngineArgs,
    config: ModelConfig,
    params,
    num_blocks: int,
    max_model_len: int,
    attention_backend: str,
    mesh: Mesh,
    pooling_type: str | None,
) -> ModelRunner:
    """The engine's model runner over the loaded `params` (with LoRA slots where
    enable_lora)."""
    spec = args.speculative_config
    return ModelRunner(
        adapter_config(config, args),
        params,
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_model_len=max_model_len,
        buckets=BucketSpec(
            args.max_num_batched_tokens,
            args.max_num_seqs,
            **({"min_mixed_tokens": SPECULATIVE_MIN_TOKENS} if spec else {}),
        ),
        attention_backend=attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        max_num_seqs=args.max_num_seqs,
        num_scheduler_steps=args.num_scheduler_steps,
        async_scheduling=args.async_scheduling,
        mesh=mesh,
        pooling_type=pooling_type,
        max_cpu_loras=args.max_cpu_loras or args.max_loras,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
    )
