"""The engine's LoRA adapters: read from disk once, kept on the host (up to max_cpu_loras),
and put into one of the params' max_loras device slots (layers/lora.py) for the steps that
run them.

The scheduler never runs more distinct adapters at once than there are slots
(core/scheduler.py), so a step's adapters always fit: each is found in its slot, or written
over the slot least recently used by a step that no request of this step needs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jvllm.config import ModelConfig
from jvllm.distributed.tensor_parallel import ParamPlacer, shard_layout
from jvllm.layers.scan import Unstacked, is_unstacked
from jvllm.logger import init_logger
from jvllm.lora.module_map import module_map
from jvllm.lora.peft_adapter import HostAdapter, read_adapter
from jvllm.lora.request import LoRARequest
from jvllm.models.model import param_axes, param_segments, param_shapes

logger = init_logger(__name__)

SLOT_NAMES = ("lora_a", "lora_b")  # a projection's adapter slots, beside its weight


class AdapterSlots:
    """`update`: update_columns jitted (the runner holds every jit entry point); `num_shards`:
    the tensor-parallel devices the slots are cut over, as the weights they sit beside."""

    def __init__(
        self, config: ModelConfig, max_cpu_loras: int, update: Callable, num_shards: int = 1
    ):
        self.config = config
        self._update = update
        self._num_shards = num_shards
        self._axes = param_axes(config)
        self._segments = param_segments(config)
        self.num_slots = config.max_loras
        self.modules = module_map(config)
        self._max_cpu_loras = max_cpu_loras
        self._host: collections.OrderedDict[int, HostAdapter] = collections.OrderedDict()
        self._holder: list[int | None] = [None] * self.num_slots  # lora_int_id in each slot
        self._last_used = [0] * self.num_slots  # the step count at each slot's last use
        self._num_steps = 0
        self._requests: dict[int, LoRARequest] = {}  # every adapter seen, to read it again

    def add(self, request: LoRARequest) -> None:
        """Check and read `request`'s adapter (ValueError naming the problem); an id already
        known must name the same adapter."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                f"at {known.lora_path}; give {request.lora_name!r} an id of its own"
            )
        if known is None:
            self._host_adapter(request)
            self._requests[request.lora_int_id] = request

    def slots_for(self, params: dict, ids: list[int | None]) -> np.ndarray:
        """i32[len(ids)]: the slot of each of `ids` (the step's requests' lora_int_id, None for
        the base model), -1 for none; adapters not in a slot yet are written into `params`
        (its leaves replaced in place)."""
        self._num_steps += 1
        needed = {i for i in ids if i is not None}
        if len(needed) > self.num_slots:
            raise RuntimeError(f"{len(needed)} adapters in one step; max_loras={self.num_slots}")
        for lora_int_id in needed - set(self._holder):
            slot = min(
                (s for s in range(self.num_slots) if self._holder[s] not in needed),
                key=lambda s: self._last_used[s],
            )
            self._write(params, slot, self._host_adapter(self._requests[lora_int_id]))
            self._holder[slot] = lora_int_id
        for lora_int_id in needed:
            self._last_used[self._holder.index(lora_int_id)] = self._num_steps
        return np.asarray([-1 if i is None else self._holder.index(i) for i in ids], np.int32)

    def slots_of_requests(self, params: dict, requests) -> np.ndarray:
        """slots_for the adapters that `requests` (Request objects) run with."""
        ids = [r.lora_request.lora_int_id if r.lora_request else None for r in requests]
        return self.slots_for(params, ids)

    def read(self, request: LoRARequest) -> HostAdapter:
        """`request`'s adapter read and checked for this model, kept nowhere (any thread)."""
        dtype = jax.numpy.dtype(self.config.dtype)
        return read_adapter(request, self.modules, self.config.max_lora_rank, dtype)

    def _host_adapter(self, request: LoRARequest) -> HostAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            adapter = self.read(request)
            logger.info(
                "read LoRA adapter %r (id %d, rank %d, %d projections) from %s",
                request.lora_name,
                request.lora_int_id,
                adapter.rank,
                len(adapter.weights),
                request.lora_path,
            )
            self._host[request.lora_int_id] = adapter
            while len(self._host) > self._max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(request.lora_int_id)
        return adapter

    def _write(self, params: dict, slot: int, adapter: HostAdapter) -> None:
        """`params` with slot `slot` holding `adapter` (zeros where it leaves a projection)."""
        logger.debug("LoRA adapter %r into slot %d", adapter.request.lora_name, slot)
        dtype = jax.numpy.dtype(self.config.dtype)
        for path, shape in self.modules.projections.items():
            num_layers, num_rows, num_inputs, num_pieces = shape
            width = num_pieces * self.config.max_lora_rank
            a, b = adapter.weights.get(path) or (
                np.zeros((num_layers, width, num_inputs), dtype),
                np.zeros((num_layers, num_rows, width), dtype),
            )
            node = _node(params, path)
            for name, value, axis in (("lora_a", a, 1), ("lora_b", b, 2)):
                value = self._mesh_layout(f"{path}.{name}", value, node[name], axis)
                node[name] = self._write_columns(node[name], value, slot * width, axis)

    def _mesh_layout(self, path: str, value: np.ndarray, stack, lora_axis: int) -> np.ndarray:
        """One slot's [L, ...] in the checkpoint's layout -> the layout of `stack` on the
        mesh (tensor_parallel.shard_layout: fused pieces shard-major, KV heads repeated)."""
        if self._num_shards == 1:
            return value
        shape = (len(stack.layers), *stack.layers[0].shape) if is_unstacked(stack) else stack.shape
        shape = (*shape[:lora_axis], value.shape[lora_axis], *shape[lora_axis + 1 :])
        axes, segments = _node(self._axes, path), _node(self._segments, path)
        return shard_layout(value, axes, segments, self._num_shards, shape)

    def _write_columns(self, stack, value: np.ndarray, start: int, axis: int):
        """`stack` [L, ...] (or its layers, split by layers/scan.py) with `value` [L, ...]
        written at `start` along `axis`."""
        if is_unstacked(stack):
            layers = zip(stack.layers, value)
            return Unstacked(tuple(self._update(x, v, start, axis - 1) for x, v in layers))
        return self._update(stack, value, start, axis)


def _node(params: dict, path: str) -> dict:
    for key in path.split("."):
        params = params[key]
    return params


def update_columns(stack: jax.Array, value: jax.Array, start: int, axis: int) -> jax.Array:
    """`stack` with `value` written from `start` along `axis` (static), cast to its dtype."""
    return jax.lax.dynamic_update_slice_in_dim(stack, value.astype(stack.dtype), start, axis)


def slot_params(config: ModelConfig, mesh: Mesh) -> dict:
    """`config`'s empty adapter slots alone, in the params' tree: the zero A and B of every
    projection that takes adapters, placed on `mesh` as the weights are."""
    place = ParamPlacer(config, mesh)

    def slots(shapes: dict, prefix: str) -> dict:
        out = {}
        for key, shape in shapes.items():
            if isinstance(shape, dict):
                inner = slots(shape, f"{prefix}{key}.")
                if inner:
                    out[key] = inner
            elif key in SLOT_NAMES:
                out[key] = place(prefix + key, np.zeros(shape.shape, shape.dtype))
        return out

    return slots(param_shapes(config), "")


def with_slots(params: dict, slots: dict) -> dict:
    """`params` with the slot tree `slots` (slot_params') in it: new dicts along the slots'
    paths, every array as it is."""
    out = dict(params)
    for key, value in slots.items():
        out[key] = with_slots(params.get(key, {}), value) if isinstance(value, dict) else value
    return out


def with_slot_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """A base model's params (loaded for `config` without adapters) with `config`'s empty
    adapter slots added."""
    return with_slots(params, slot_params(config, mesh))
