"""Start-up: the native CPU kernels the engine will run, built while the model loads, and
compiling every bucket (EngineArgs.compile_all_buckets), up front or in the background, saying
so in the log."""

import time

from jvllm.attention.backends import default_backend, prepare_backend
from jvllm.engine.arg_utils import EngineArgs
from jvllm.layers import cpu_dense
from jvllm.logger import init_logger
from jvllm.model_loader.loader import expected_dtype
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
