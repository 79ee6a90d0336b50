"""LoRA adapters in a group of data-parallel ranks (worker/rank_group.py): each rank serves its
own requests' adapters in max_loras slots of its own, as one engine does, and its scheduler
keeps each step within them.

Each rank's slots (every adapter-taking projection's A [L, S W', I] and B [L, O, S W']) lie on
its own row of the mesh, cut over its T devices as one engine at T cuts them, and its
AdapterSlots writes them there, in its own process. The group's step takes every rank's slots
as one array a projection, its slot axis D times as long and cut over "data" (joined without
a copy), so each device sees its rank's S slots under the slot ids its rank's requests got.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jvllm.config import ModelConfig
from jvllm.distributed.mesh import DP_AXIS, TP_AXIS, join_over_ranks, replica_mesh
from jvllm.lora.slots import AdapterSlots, slot_params, update_columns, with_slots
from jvllm.models.model import param_axes

_SLOT_AXIS = "lora"  # the logical axis of a projection's slots (layers/linear.py)


class RankAdapters:
    def __init__(self, config: ModelConfig, mesh: Mesh, local_ranks: list[int], max_cpu_loras: int):
        """`config`: the model with its adapter slots (max_loras a rank); `mesh`: the group's
        D x T mesh; `local_ranks`: the ranks whose rows are this process's."""
        self._mesh, self._local_ranks = mesh, local_ranks
        self._axes = param_axes(config)
        update = jax.jit(update_columns, static_argnums=3)
        num_shards = mesh.shape[TP_AXIS]
        # Each local rank's AdapterSlots, what its engine checks and reads adapters with.
        self.slots = {
            r: AdapterSlots(config, max_cpu_loras, update, num_shards) for r in local_ranks
        }
        self._trees = {r: slot_params(config, replica_mesh(mesh, r)) for r in local_ranks}
        # (the arrays joined, the join): held, so that a new array is never taken for one of
        # them (an id of a freed array may come back).
        self._joined: tuple[list[jax.Array], dict] | None = None

    def slots_for(self, rank: int, requests) -> np.ndarray:
        """i32[len(requests)]: each of rank `rank`'s requests' slot (-1: none), its adapter
        written into the rank's slots first where it is not there yet."""
        return self.slots[rank].slots_of_requests(self._trees[rank], requests)

    def with_slots(self, params: dict) -> dict:
        """The group's `params` with every rank's slots in them, as the step takes them."""
        trees = [self._trees[r] for r in self._local_ranks]
        leaves = [a for tree in trees for a in jax.tree.leaves(tree)]
        joined = self._joined
        if joined is None or any(a is not b for a, b in zip(leaves, joined[0])):  # written
            joined = self._joined = (leaves, jax.tree_util.tree_map_with_path(self._join, *trees))
        return with_slots(params, joined[1])

    def _join(self, path, *arrays: jax.Array) -> jax.Array:
        """The local ranks' slots of one projection (each [.., S W', ..] on its row) -> the
        group's [.., D S W', ..], the slot axis cut over "data"."""
        axis = _axes_at(self._axes, path).index(_SLOT_AXIS)
        return join_over_ranks(list(arrays), axis, self._mesh)


def slots_over_ranks(specs: dict, config: ModelConfig) -> dict:
    """shard_map's in_specs of the params (`specs`, with `config`'s adapter slots), each
    projection's slot axis cut over "data" as RankAdapters.with_slots gives them."""
    axes = param_axes(config)

    def over_ranks(path, spec):
        leaf_axes = _axes_at(axes, path)
        if not isinstance(spec, PartitionSpec) or _SLOT_AXIS not in leaf_axes:
            return spec
        entries = [*spec, *[None] * (len(leaf_axes) - len(spec))]
        entries[leaf_axes.index(_SLOT_AXIS)] = DP_AXIS
        return PartitionSpec(*entries)

    return jax.tree_util.tree_map_with_path(over_ranks, specs)


def _axes_at(axes: dict, path) -> tuple:
    """The logical axes of the param at a tree path (a quantized param's fields: its own)."""
    for key in path:
        if not isinstance(axes, dict):
            break
        axes = axes[key.key]
    return axes
