"""The device half of sleep mode over one model runner (engine/sleep.py keeps the engine's
half): free its weights and KV cache, bring each back, and load new weights into the device, or
into the host copy while the weights sleep. The buffers themselves move in device_buffers.py.

The Worker holds one over its runner; a group of data-parallel ranks holds one over the group's
runner, which its ranks share (RankWorker in worker/rank_group_worker.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax

from jvllm.config import ModelConfig
from jvllm.distributed.tensor_parallel import ParamPlacer
from jvllm.lora.slots import SLOT_NAMES
from jvllm.model_loader.weight_update import read_weight_update
from jvllm.quantization import is_quantized
from jvllm.worker import device_buffers


class DeviceSleep:
    def __init__(self, runner, model_config: ModelConfig):
        """`runner`: a model runner (its params, KV cache, `_state_spec`, draft); `model_config`:
        the loaded model's, which reads the weight updates."""
        self._runner = runner
        self._model_config = model_config
        # While the weights sleep: param path -> host copy (sleep level 2: only what
        # load_weights gave since, and the LoRA slots, which are adapters, not the model's).
        self._sleeping_params: device_buffers.HostParams | None = None
        # A speculative draft's params while they sleep (device_buffers.release_draft_params).
        self._sleeping_draft = None

    def has_quantized_weights(self) -> bool:
        specs = device_buffers.param_specs(self._runner)
        return any(is_quantized(s) for s in jax.tree.leaves(specs, is_leaf=is_quantized))

    def sleep(self, level: int) -> None:
        """Free the weights (level 1: kept in host memory; 2: discarded but the LoRA slots and a
        speculative draft's) and the KV cache."""
        runner = self._runner
        keep = lambda path: level == 1 or _is_adapter_slot(path)
        self._sleeping_params = device_buffers.release_params(runner, keep)
        if runner.draft is not None:  # to host memory, at either level
            self._sleeping_draft = device_buffers.release_draft_params(runner)
        device_buffers.release_kv_cache(runner)

    def missing_params(self) -> list[str]:
        """The params that waking the weights would lack (a level-2 sleep discarded them, and
        load_weights has not given them since); none while the weights are on the device."""
        host = self._sleeping_params
        if host is None:
            return []
        return [p for p in device_buffers.param_specs(self._runner) if p not in host]

    def wake_up_weights(self) -> None:
        """The weights back on the device (nothing to do where they are)."""
        if self._sleeping_params is None:
            return
        device_buffers.restore_params(self._runner, self._sleeping_params)
        self._sleeping_params = None
        if self._sleeping_draft is not None:
            device_buffers.restore_draft_params(self._runner, self._sleeping_draft)
            self._sleeping_draft = None

    def wake_up_kv_cache(self) -> None:
        """A zero KV cache, laid out as before sleep (nothing to do where it is)."""
        if self._runner.kv_cache is None:
            device_buffers.restore_kv_cache(self._runner)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Replace the params that `weights` (HF name, array) pairs make (a subset is fine;
        model_loader/weight_update.py): on the device, or into the host copy while the weights
        sleep; -> the params' paths."""
        runner = self._runner
        layout = ParamPlacer(runner.config, runner.mesh).host_layout  # shard-major, as loaded
        loaded = read_weight_update(self._model_config, weights, layout)
        host = {p: device_buffers.in_runner_layout(runner, p, x) for p, x in loaded.items()}
        if self._sleeping_params is not None:
            self._sleeping_params.update(host)
        else:
            device_buffers.replace_params(runner, host)
        return set(host)


def _is_adapter_slot(path: str) -> bool:
    """Whether a param is a LoRA slot (jvllm/lora/), which holds adapters, not the model."""
    return path.rsplit(".", 1)[-1] in SLOT_NAMES
