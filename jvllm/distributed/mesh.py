"""The device mesh: axes ("data", "model") over the first D*T devices, row d the devices of
data-parallel replica d, each row one tensor-parallel group of T devices."""

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jvllm.config import ModelConfig
from jvllm.layers.params import DP_AXIS, TP_AXIS

_CPU_HINT = (
    "; on CPU, more devices come from XLA_FLAGS=--xla_force_host_platform_device_count=N, "
    "set before JAX starts"
)


def ensure_cpu_devices(count: int) -> None:
    """Ask XLA for `count` CPU devices (for scripts run on a CPU with fake devices); only
    before JAX starts its backends, and only the CPU platform reads it."""
    if count > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def make_mesh(data_parallel_size: int = 1, tensor_parallel_size: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh of shape [D, T] over the first D*T devices (of every process,
    once jax.distributed is initialized)."""
    devices = jax.devices() if devices is None else list(devices)
    needed = data_parallel_size * tensor_parallel_size
    if needed > len(devices):
        platform = devices[0].platform if devices else "no"
        raise ValueError(
            f"data_parallel_size ({data_parallel_size}) x tensor_parallel_size "
            f"({tensor_parallel_size}) needs {needed} devices, but {len(devices)} {platform} "
            f"device(s) are present; lower them{_CPU_HINT if platform == 'cpu' else ''}"
        )
    grid = np.array(devices[:needed], dtype=object).reshape(data_parallel_size, -1)
    return Mesh(grid, (DP_AXIS, TP_AXIS))


def engine_mesh(
    tensor_parallel_size: int, data_parallel_size: int, data_parallel_rank: int | None
) -> Mesh:
    """The [1, T] mesh one engine (one data-parallel replica) runs on: with one replica a
    process (several processes, data_parallel_size of them), its own process's devices."""
    if data_parallel_size > 1 and data_parallel_rank is None:
        raise ValueError(
            f"data_parallel_size={data_parallel_size}: an LLMEngine runs one replica, so it "
            "needs data_parallel_rank; LLM(...) and `jvllm serve` run them all "
            "(jvllm.engine.data_parallel.make_engine)"
        )
    if data_parallel_size > 1 and data_parallel_size == jax.process_count():
        local = [d for d in jax.devices() if d.process_index == data_parallel_rank]
        return make_mesh(1, tensor_parallel_size, local)
    mesh = make_mesh(data_parallel_size, tensor_parallel_size)
    return replica_mesh(mesh, data_parallel_rank or 0)


def rank_group_mesh(data_parallel_size: int, tensor_parallel_size: int) -> Mesh:
    """The D x T mesh of data-parallel ranks that step as one (worker/rank_group.py): across
    processes (one rank a process), row r the first T devices of process r; in one process,
    make_mesh's."""
    if data_parallel_size > 1 and data_parallel_size == jax.process_count():
        rows = [
            [d for d in jax.devices() if d.process_index == r][:tensor_parallel_size]
            for r in range(data_parallel_size)
        ]
        if any(len(row) < tensor_parallel_size for row in rows):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs that many devices in each "
                f"of the {data_parallel_size} processes, one data-parallel rank each{_CPU_HINT}"
            )
        return Mesh(np.array(rows, dtype=object), (DP_AXIS, TP_AXIS))
    return make_mesh(data_parallel_size, tensor_parallel_size)


def replica_mesh(mesh: Mesh, rank: int) -> Mesh:
    """Data-parallel replica `rank`'s own [1, T] mesh: one row of `mesh`."""
    return Mesh(mesh.devices[rank : rank + 1], mesh.axis_names)


def num_shards(mesh: Mesh | None) -> int:
    """T: the devices of `mesh`'s "model" axis, each model cut over (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def num_ranks(mesh: Mesh | None) -> int:
    """D: the rows of `mesh`'s "data" axis (1 without a mesh, and on a replica's own mesh)."""
    return 1 if mesh is None else mesh.shape[DP_AXIS]


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy of the array on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def join_over_ranks(arrays: list[jax.Array], axis: int, mesh: Mesh) -> jax.Array:
    """This process's ranks' arrays, each on its own row of the [D, T] `mesh` (replica_mesh's),
    in rank order -> the one array of every rank's, `axis` D times as long and cut over "data"
    (each array's own cut kept on its other axes), made of their buffers without a copy."""
    first = arrays[0]
    spec = [*first.sharding.spec, *[None] * (first.ndim - len(first.sharding.spec))]
    spec[axis] = DP_AXIS
    shape = list(first.shape)
    shape[axis] *= mesh.shape[DP_AXIS]
    shards = [s.data for a in arrays for s in a.addressable_shards]
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards)


def describe_placement(mesh: Mesh, params, config: ModelConfig) -> str:
    """For the start-up log: the devices, and each one's bytes of weights, when there are
    several; under expert parallelism, that the experts are placed whole, and how many a
    device holds."""
    if mesh.size == 1:
        return ""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    weight_bytes = sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(params)
        for shard in leaf.addressable_shards
        if shard.device == device
    )
    experts = ""
    if config.is_expert_parallel:  # over every device of the mesh (EXPERT_PARALLEL_RULES)
        num_local = config.num_experts // mesh.size
        experts = f", routed experts placed whole: {num_local} of {config.num_experts} a device"
    ranks = f"data_parallel_size={mesh.shape[DP_AXIS]}, " if mesh.shape[DP_AXIS] > 1 else ""
    return (
        f" on {mesh.size} devices ({ranks}tensor_parallel_size={mesh.shape[TP_AXIS]}{experts}), "
        f"{weight_bytes / 2**20:.1f} MiB of weights per device"
    )
