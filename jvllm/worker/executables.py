"""The runner's compiled executables: compiled on first use, up front, or in background threads.

A shape is a (Bucket, kind, sampler plan) triple (see step_compiler.Shape). `get` returns a
shape's executable if it is ready; `wait` returns it, compiling it in the caller unless a
compile of it is already running, which it then waits for (a queued one is taken out of the
queue and compiled at once: a step waits for its own shape, never for the shapes queued before
it). XLA releases the GIL while it compiles, so the engine keeps stepping while the threads
work.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax

from jvllm.logger import init_logger

logger = init_logger(__name__)

# Compiles at once: XLA loads a cached executable on one core (14 buckets of SmolLM2 from the
# persistent cache: 24 s one at a time, 16 s two at a time).
_COMPILE_THREADS = 2
# "0": nothing compiles in a background thread; each step runs in the smallest compiled bucket
# that holds it, or compiles its own first, as in lockstep. On a machine of few cores whose
# engines are short-lived (the tests: docs/testing.md), the compiles a step queues ahead take
# the cores from the steps and mostly end unused. "1" or unset: they run.
BACKGROUND_COMPILES_ENV = "JVLLM_BACKGROUND_COMPILES"


def background_compiles_allowed() -> bool:
    setting = os.environ.get(BACKGROUND_COMPILES_ENV)
    if setting not in (None, "0", "1"):
        raise ValueError(f"{BACKGROUND_COMPILES_ENV}={setting!r}; allowed: '0', '1' or unset")
    return setting != "0"


Shape = Any  # step_compiler.Shape: (Bucket, kind, sampler plan)


class Executables:
    def __init__(
        self,
        compile_fn: Callable[[Shape], jax.stages.Compiled],
        describe: Callable[[Shape], str],
        lockstep: bool = False,
    ):
        """compile_fn(shape) compiles one shape (in any thread); describe(shape) names it.
        `lockstep`: nothing compiles in the background (see compile_in_background), nor
        where BACKGROUND_COMPILES_ENV is "0"."""
        self._compile_fn = compile_fn
        self.lockstep = lockstep
        self._background_allowed = background_compiles_allowed()
        self._describe = describe
        self._ready: dict[Shape, jax.stages.Compiled] = {}
        self._queued: dict[Shape, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            _COMPILE_THREADS, thread_name_prefix="jvllm-compile"
        )
        # The interpreter joins pool threads at exit after running what is queued; drop the
        # queue first, so that a script does not wait for buckets it will never use.
        pool = weakref.ref(self._pool)
        threading._register_atexit(lambda: (p := pool()) and p.shutdown(cancel_futures=True))
        self.compile_seconds = 0.0  # every compile's own time, in any thread
        self.wait_seconds = 0.0  # time steps spent waiting for a compile (theirs or a queued one)
        self._num_background = 0
        self._num_background_done = 0

    @property
    def background(self) -> bool:
        """Whether shapes compile in background threads."""
        return self._background_allowed and not self.lockstep

    def __len__(self) -> int:
        return len(self._ready)

    def get(self, shape: Shape) -> jax.stages.Compiled | None:
        return self._ready.get(shape)

    def wait(self, shape: Shape) -> jax.stages.Compiled:
        """`shape`'s executable, compiling it now if no thread is on it; logs what it cost."""
        exe = self._ready.get(shape)
        if exe is not None:
            return exe
        start = time.perf_counter()
        with self._lock:
            future = self._queued.get(shape)
            if future is not None and future.cancel():  # still queued: compile it here
                del self._queued[shape]
                self._num_background -= 1
                future = None
        if future is not None:
            future.result()
            seconds = time.perf_counter() - start
            logger.info(
                "waited %.1fs for %s, compiling in the background", seconds, self._describe(shape)
            )
        else:
            exe = self._timed_compile(shape)
            with self._lock:
                self._store(shape, exe)
            seconds = time.perf_counter() - start
            logger.info("compiled %s on first use in %.1fs", self._describe(shape), seconds)
        self.wait_seconds += seconds
        return self._ready[shape]

    def compile_now(
        self, shapes: list[Shape], progress: bool, on_ready: Callable[[Shape], None]
    ) -> None:
        """Compile every shape not yet ready, `_COMPILE_THREADS` at a time, and return when all
        are; `on_ready(shape)` runs for each in this thread, in order, once it is ready."""
        shapes = [s for s in shapes if s not in self._ready]
        futures = [self._pool.submit(self._timed_compile, s) for s in shapes]
        for i, (shape, future) in enumerate(zip(shapes, futures, strict=True)):
            exe = future.result()
            with self._lock:
                self._store(shape, exe)
            if progress:
                logger.info("compiled %d/%d: %s", i + 1, len(shapes), self._describe(shape))
            on_ready(shape)

    def compile_in_background(self, shapes: Iterable[Shape]) -> None:
        """Queue the shapes (in this order) that are neither ready nor queued. Not in lockstep
        (several processes): which executables are ready must not depend on a thread's timing,
        since it picks each step's bucket, and every process must pick the same."""
        if not self.background:
            return
        with self._lock:
            for shape in shapes:
                if shape not in self._ready and shape not in self._queued:
                    self._num_background += 1
                    self._queued[shape] = self._pool.submit(self._background, shape)

    def wait_all(self) -> None:
        """Return when every queued shape is compiled."""
        with self._lock:
            futures = list(self._queued.values())
        for future in futures:
            future.result()

    def cancel_queued(self) -> None:
        """Drop the compiles no thread has started; the running ones finish."""
        with self._lock:
            for shape, future in list(self._queued.items()):
                if future.cancel():
                    del self._queued[shape]
                    self._num_background -= 1

    def _background(self, shape: Shape) -> None:
        try:
            exe = self._timed_compile(shape)
        except Exception:
            # A step that needs the shape gets the error from the future; say it now too.
            logger.exception("compiling %s in the background failed", self._describe(shape))
            raise
        with self._lock:
            self._store(shape, exe)
            self._queued.pop(shape, None)
            self._num_background_done += 1
            done, total = self._num_background_done, self._num_background
        logger.info("compiled %d/%d in the background: %s", done, total, self._describe(shape))

    def _timed_compile(self, shape: Shape) -> jax.stages.Compiled:
        start = time.perf_counter()
        exe = self._compile_fn(shape)
        self.compile_seconds += time.perf_counter() - start
        return exe

    def _store(self, shape: Shape, exe: jax.stages.Compiled) -> None:
        """Called with the lock held."""
        self._ready.setdefault(shape, exe)
