"""Compiling every bucket at start-up (EngineArgs.compile_all_buckets), up front or in the
background, and saying so in the log."""

import time

from jvllm.logger import init_logger
from jvllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


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
