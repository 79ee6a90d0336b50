"""What RL training loops (verl, OpenRLHF, TRL) call between training steps, with vLLM's names:
sleep to free the device for training, wake up, push the trained weights in, and forget the
prefix cache, whose KV the old weights computed.

Level 1 sleep keeps the weights in host memory and drops the KV cache; level 2 drops both, the
weights then coming back only through load_weights (vLLM: "reload the weights"). Every buffer
comes back with the layout the executables were compiled for, so waking compiles nothing
(worker/device_buffers.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax

from jvllm.distributed.tensor_parallel import ParamPlacer
from jvllm.logger import init_logger
from jvllm.model_loader.weight_update import read_weight_update
from jvllm.quantization import is_quantized
from jvllm.worker import device_buffers

logger = init_logger(__name__)

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")  # what wake_up(tags) brings back


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep."""


class SleepMode:
    """An LLMEngine's sleep state, and its weight updates (which go to the host copy while
    the weights sleep)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._asleep: set[str] = set()  # SLEEP_TAGS now released
        self._level: int | None = None
        # While the weights sleep: param path -> host copy (level 2: only what load_weights
        # gave since, and the LoRA slots, which are adapters, not the model's weights).
        self._host: device_buffers.HostParams = {}

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
        if not self._engine.args.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True")
        if level not in SLEEP_LEVELS:
            raise ValueError(
                f"sleep level must be one of {SLEEP_LEVELS} (1: weights to host memory, KV cache "
                f"discarded; 2: both discarded), got {level!r}"
            )
        if self._asleep:
            logger.warning("sleep(level=%d): the engine is already asleep", level)
            return
        self._check_idle("sleep")
        runner = self._engine.model_runner
        if level == 2 and self._has_quantized_weights():
            raise ValueError(
                "sleep(level=2) discards the weights, which only load_weights brings back, and "
                f"load_weights does not take quantized weights ({self._quantization}): use "
                "sleep(level=1)"
            )
        self._host = device_buffers.release_params(
            runner, keep_on_host=lambda path: level == 1 or _is_adapter_slot(path)
        )
        device_buffers.release_kv_cache(runner)
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
        runner = self._engine.model_runner
        if "weights" in tags and "weights" in self._asleep:
            missing = [p for p in device_buffers.param_specs(runner) if p not in self._host]
            if missing:
                raise ValueError(
                    f"wake_up: sleep(level=2) discarded the weights, and load_weights has not "
                    f"given {len(missing)} params since ({', '.join(missing[:4])}"
                    f"{', ...' if len(missing) > 4 else ''}): load the weights first"
                )
            device_buffers.restore_params(runner, self._host)
            self._host = {}
            self._asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            device_buffers.restore_kv_cache(runner)
            self._engine.scheduler.kv_cache_manager.reset_prefix_cache()
            self._asleep.discard("kv_cache")
        if not self._asleep:
            self._level = None

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Replace the params that `weights` (HF name, array) pairs make (a subset is fine;
        model_loader/weight_update.py) and reset the prefix cache; -> the params' paths."""
        self._check_idle("load_weights")
        if self._has_quantized_weights():
            raise ValueError(
                f"load_weights does not take quantized weights ({self._quantization}): it reads "
                "float tensors into float params; start the engine without quantization"
            )
        runner = self._engine.model_runner
        layout = ParamPlacer(runner.config, runner.mesh).host_layout  # shard-major, as loaded
        loaded = read_weight_update(self._engine.model_config, weights, layout)
        host = {p: device_buffers.in_runner_layout(runner, p, x) for p, x in loaded.items()}
        if "weights" in self._asleep:
            self._host.update(host)
        else:
            device_buffers.replace_params(runner, host)
        self._engine.scheduler.kv_cache_manager.reset_prefix_cache()
        return set(host)

    def _check_idle(self, call: str) -> None:
        engine = self._engine
        if jax.process_count() > 1:
            raise ValueError(f"{call} runs in one process; this engine spans several")
        if engine.held_by_step_loop:
            raise RuntimeError(f"{call}: a StepLoop holds the KV cache; finish it first")
        num_unfinished = engine.get_num_unfinished_requests()
        if num_unfinished:
            raise RuntimeError(
                f"{call} needs an idle engine, and {num_unfinished} requests are unfinished: "
                "let them finish or abort them first"
            )

    def _has_quantized_weights(self) -> bool:
        specs = device_buffers.param_specs(self._engine.model_runner)
        return any(is_quantized(s) for s in jax.tree.leaves(specs, is_leaf=is_quantized))

    @property
    def _quantization(self) -> str:
        return f"quantization={self._engine.args.quantization!r}"


def _is_adapter_slot(path: str) -> bool:
    """Whether a param is a LoRA slot (jvllm/lora/), which holds adapters, not the model."""
    return path.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
