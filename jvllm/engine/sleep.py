"""What RL training loops (verl, OpenRLHF, TRL) call between training steps, with vLLM's names:
sleep to free the device for training, wake up, push the trained weights in, and forget the
prefix cache, whose KV the old weights computed.

Level 1 sleep keeps the weights in host memory and drops the KV cache; level 2 drops both, the
weights then coming back only through load_weights (vLLM: "reload the weights"). Every buffer
comes back with the layout the executables were compiled for, so waking compiles nothing
(worker/device_buffers.py). This is the engine's half (the state, what it requires of the
engine, the prefix cache); the Worker frees and refills the device.

An engine that spans several processes (engine/leader.py, engine/process_data_parallel.py)
runs each call on every process: process 0's engine checks it, announces it to the others
(`Peers`), which run it on their engines in the same order, and then runs it itself, so that
their device work (placing arrays cut across processes) goes in step. Weights given to
load_weights travel from process 0 with the announcement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from jvllm.logger import init_logger

logger = init_logger(__name__)

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")  # what wake_up(tags) brings back


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep."""


class Peers(Protocol):
    """The other processes of an engine that spans several, as process 0's engine reaches
    them (LLMEngine.peers)."""

    def num_unfinished_elsewhere(self) -> int:
        """The requests unfinished on the other processes' engines and not on this one."""

    def announce(self, call: str, *args) -> None:
        """Have every other process run LLMEngine.`call`(*args) (one of multihost.py's
        ENGINE_CALLS) before this one runs it."""


class SleepMode:
    """An LLMEngine's sleep state, and its weight updates (which go to the worker's host copy
    while the weights sleep)."""

    def __init__(self, engine, enabled: bool, quantization: str | None) -> None:
        self._engine = engine
        self._worker = engine.worker
        self._enabled = enabled  # enable_sleep_mode
        self._quantization = f"quantization={quantization!r}"
        self._asleep: set[str] = set()  # SLEEP_TAGS now released
        self._level: int | None = None

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def check_awake(self) -> None:
        if self._asleep:
            released = " and ".join(sorted(self._asleep))
            raise EngineSleepingError(
                f"the engine is asleep (sleep(level={self._level}), its {released} released): "
                "call wake_up() before adding requests"
            )

    def sleep(self, level: int = 1) -> None:
        if not self._enabled:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True")
        if level not in SLEEP_LEVELS:
            raise ValueError(
                f"sleep level must be one of {SLEEP_LEVELS} (1: weights to host memory, KV cache "
                f"discarded; 2: both discarded), got {level!r}"
            )
        if self._asleep:
            logger.warning("sleep(level=%d): the engine is already asleep", level)
            return
        self.check_idle("sleep")
        if level == 2 and self._worker.has_quantized_weights():
            raise ValueError(
                "sleep(level=2) discards the weights, which only load_weights brings back, and "
                f"load_weights does not take quantized weights ({self._quantization}): use "
                "sleep(level=1)"
            )
        self._announce("sleep", level)
        self._worker.sleep(level)
        self._engine.scheduler.kv_cache_manager.reset_prefix_cache()
        self._asleep, self._level = set(SLEEP_TAGS), level
        kept = "kept in host memory" if level == 1 else "discarded"
        logger.info("asleep (level %d): the weights %s, the KV cache discarded", level, kept)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back `tags` (None: all of SLEEP_TAGS), the weights first: the KV cache zeroed
        and the prefix cache reset."""
        tags = SLEEP_TAGS if tags is None else tuple(tags)
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad:
            raise ValueError(f"wake_up tags must be among {SLEEP_TAGS}, got {bad}")
        if not self._asleep:
            logger.warning("wake_up(): the engine is not asleep")
            return
        missing = self._worker.missing_params() if "weights" in tags else []
        if missing:
            raise ValueError(
                f"wake_up: sleep(level=2) discarded the weights, and load_weights has not "
                f"given {len(missing)} params since ({', '.join(missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''}): load the weights first"
            )
        self._announce("wake_up", list(tags))
        if "weights" in tags and "weights" in self._asleep:
            self._worker.wake_up_weights()
            self._asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self._worker.wake_up_kv_cache()
            self._engine.scheduler.kv_cache_manager.reset_prefix_cache()
            self._asleep.discard("kv_cache")
        if not self._asleep:
            self._level = None

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Replace the params that `weights` (HF name, array) pairs make (a subset is fine;
        model_loader/weight_update.py) and reset the prefix cache; -> the params' paths."""
        self.check_idle("load_weights")
        if self._worker.has_quantized_weights():
            raise ValueError(
                f"load_weights does not take quantized weights ({self._quantization}): it reads "
                "float tensors into float params; start the engine without quantization"
            )
        if self._engine.peers is not None:
            weights = list(weights)  # sent to the other processes, then read here
            self._announce("load_weights", weights)
        replaced = self._worker.load_weights(weights)
        self._engine.scheduler.kv_cache_manager.reset_prefix_cache()
        return replaced

    def check_idle(self, call: str) -> None:
        """What `call` (sleep, load_weights) requires of the engine: raises what it lacks."""
        engine = self._engine
        if engine.held_by_step_loop:
            raise RuntimeError(f"{call}: a StepLoop holds the KV cache; finish it first")
        num_unfinished = engine.get_num_unfinished_requests()
        if engine.peers is not None:
            num_unfinished += engine.peers.num_unfinished_elsewhere()
        if num_unfinished:
            raise RuntimeError(
                f"{call} needs an idle engine, and {num_unfinished} requests are unfinished: "
                "let them finish or abort them first"
            )

    def _announce(self, call: str, *args) -> None:
        if self._engine.peers is not None:
            self._engine.peers.announce(call, *args)


def check_replicas_idle(engines, call: str) -> None:
    """Every replica idle before `call` (sleep, load_weights) changes any: the ranks of a group
    share their weights and KV cache, so one busy rank refuses it for all."""
    for engine in engines:
        engine.sleep_mode.check_idle(call)
