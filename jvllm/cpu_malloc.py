"""Host memory for XLA:CPU's temporaries, reused rather than faulted in again on every call.

XLA:CPU allocates an executable's temporaries on each call. glibc serves an allocation over 32
MiB, and a thread's whole arena (XLA's worker threads have their own, of at most 64 MiB), with
fresh pages from mmap and returns them on free, so every call faulted its temporaries in again,
a tenth of a batch-64 decode step of the default model (BENCHMARKS.md, "Page faults on every
step"). One arena, no mmap and no trimming make freed
temporaries come back with their pages. It takes effect only before XLA's threads exist (an
arena is chosen at a thread's first allocation), so the engine applies it before it first
touches JAX; freed memory then stays with the process for its next step.
`JVLLM_CPU_MALLOC_TUNING=0` leaves malloc as it is.
"""

import ctypes
import importlib.metadata
import os

import jax
from jax._src import xla_bridge

from jvllm.logger import init_logger

logger = init_logger(__name__)

MALLOC_TUNING_ENV = "JVLLM_CPU_MALLOC_TUNING"
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above; whether it was done (not: turned off, another C library,
    or JAX already running, which a DEBUG line says)."""
    if os.environ.get(MALLOC_TUNING_ENV, "1") == "0" or not _will_run_on_cpu():
        return False
    if xla_bridge.backends_are_initialized():
        logger.debug(
            "malloc left as it is: JAX started before the engine, and XLA's threads have their "
            "own arenas (MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 "
            "in the environment do the same)"
        )
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)


def _will_run_on_cpu() -> bool:
    """Whether JAX will pick the CPU, told without starting it: the platforms asked for, else
    no accelerator plugin installed."""
    platforms = jax.config.jax_platforms  # e.g. "cpu", "cuda,cpu"; unset: what is installed
    if platforms:
        return platforms.split(",")[0] == "cpu"
    return not importlib.metadata.entry_points(group="jax_plugins")
