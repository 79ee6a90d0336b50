"""Tensor parallelism (Megatron's layout) over the mesh's "model" axis of T devices.

Each device holds 1/T of every sharded weight: q|k|v and gate|up column-parallel (cut on their
output axis), o and down row-parallel (cut on their input axis; the layer all-reduces its
partial outputs, layers/parallel.py), the embedding and an untied LM head cut on the vocabulary
(padded to a multiple of T), and the KV cache cut on its KV-head axis. Everything else (norms,
routers, position tables) is replicated.

A fused axis is laid out shard-major (params.py's Segments): device i's slice of q|k|v holds its
N/T query heads, then its K/T KV heads of k and of v, so that the slice is exactly the
q|k|v weight of `shard_config`'s model, the per-device module `shard_map` runs. With fewer KV
heads than devices (K < T, T a multiple of K), KV head j is repeated on the T/K devices whose
query heads use it, as vLLM does: every device holds one.

Under expert parallelism (distributed/expert_parallel.py) the routed expert stacks follow
EXPERT_PARALLEL_RULES instead: cut by expert, each expert whole (`axis_rules`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jvllm.config import ModelConfig
from jvllm.distributed.expert_parallel import (
    EXPERT_PARALLEL_RULES,
    check_expert_parallel,
    is_expert_stack,
)
from jvllm.distributed.mesh import TP_AXIS
from jvllm.models.model import param_axes, param_segments, param_shapes
from jvllm.quantization import is_quantized

# Logical axis names (layers/params.py) -> the mesh axis that cuts them; the rest replicate.
AXIS_RULES = {"heads": TP_AXIS, "kv_heads": TP_AXIS, "mlp": TP_AXIS, "vocab": TP_AXIS}


def axis_rules(axes: tuple[str | None, ...], is_expert_parallel: bool) -> dict[str, str]:
    """The rules that place a param of these logical axes: an expert stack's under expert
    parallelism, AXIS_RULES otherwise."""
    if is_expert_parallel and is_expert_stack(axes):
        return EXPERT_PARALLEL_RULES
    return AXIS_RULES


def check_tensor_parallel(config: ModelConfig, num_shards: int) -> None:
    """Raise ValueError, naming the numbers, unless `config` splits over `num_shards` devices."""
    if num_shards == 1:
        return
    t, k = num_shards, config.num_kv_heads
    problems = []
    if config.num_heads % t:
        problems.append(f"the {config.num_heads} query heads")
    if k % t and t % k:
        problems.append(
            f"the {k} KV heads (with fewer KV heads than devices, tensor_parallel_size must be "
            "a multiple of them, each then repeated on tensor_parallel_size / K devices)"
        )
    if config.is_expert_parallel:
        check_expert_parallel(config, t)
    elif _mlp_width(config) % t:
        what = "each expert's" if config.num_experts else "the MLP's"
        problems.append(f"{what} intermediate size {_mlp_width(config)}")
    # A mixture of experts with dense MLP layers before its sparse ones (DeepSeek's
    # first_k_dense_replace, Qwen-MoE's dense prefix) cuts their F too.
    has_dense = config.option("first_k_dense_replace") or config.option("num_dense_layers")
    if config.num_experts and has_dense and config.intermediate_size % t:
        problems.append(f"the dense layers' intermediate size {config.intermediate_size}")
    shared = config.shared_expert_intermediate_size
    if shared % t:
        problems.append(f"the shared expert's intermediate size {shared}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={t} does not divide {' nor '.join(problems)} of "
            f"{config.architecture}; choose a tensor_parallel_size that does"
        )


def _mlp_width(config: ModelConfig) -> int:
    """The F that the MLP's (or each expert's) gate|up and down are cut on."""
    if config.num_experts:
        return config.moe_intermediate_size or config.intermediate_size
    return config.intermediate_size


def num_kv_heads(config: ModelConfig, num_shards: int) -> int:
    """The KV heads the cache holds over all devices: K, or T when K < T (repeated heads)."""
    return max(config.num_kv_heads, num_shards)


def shard_config(config: ModelConfig, num_shards: int) -> ModelConfig:
    """The model one device runs: its share of the heads, of F and of the (padded) vocabulary;
    under expert parallelism, its share of the routed experts, each of the whole F."""
    if num_shards == 1:
        return config
    check_tensor_parallel(config, num_shards)
    t = num_shards
    expert_width = config.moe_intermediate_size // t
    if config.is_expert_parallel:  # kept where the experts read it, intermediate_size being cut
        expert_width = config.moe_intermediate_size or config.intermediate_size
    return dataclasses.replace(
        config,
        vocab_size=math.ceil(config.vocab_size / t),
        # A mixture of experts that reads moe_intermediate_size never reads this one.
        intermediate_size=max(1, config.intermediate_size // t),
        moe_intermediate_size=expert_width,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // t,
        num_heads=config.num_heads // t,
        num_kv_heads=num_kv_heads(config, t) // t,
        num_shards=t,
    )


def param_specs(config: ModelConfig) -> dict:
    """Each param's PartitionSpec over the mesh, in the params' tree."""

    def spec(axes: tuple[str, ...]) -> PartitionSpec:
        rules = axis_rules(axes, config.is_expert_parallel)
        return PartitionSpec(*(rules.get(a) for a in axes))

    return jax.tree.map(
        spec,
        param_axes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def params_in_specs(specs: dict, params: dict) -> dict:
    """shard_map's in_specs for `params`: `specs` (param_specs, or layers/scan.py's
    unstack_specs of them), where a quantized weight's one spec becomes one a field, each its
    array's own NamedSharding's (ParamPlacer's place_quantized and place_blocks cut them, and
    quantization/online.py keeps the cut of the float weights it quantizes)."""

    def spec_of(spec, param):
        if is_quantized(param):
            return jax.tree.map(lambda a: a.sharding.spec, param)
        return spec

    return jax.tree.map(
        spec_of, specs, params, is_leaf=lambda x: isinstance(x, PartitionSpec) or is_quantized(x)
    )


def sharded_param_shapes(config: ModelConfig, num_shards: int) -> dict:
    """The params as the mesh holds them (T devices' slices side by side), as ShapeDtypeStructs:
    the checkpoint's shapes, with K repeated up to T and the vocabulary padded."""
    local = param_shapes(shard_config(config, num_shards))

    def whole(spec: jax.ShapeDtypeStruct, pspec: PartitionSpec) -> jax.ShapeDtypeStruct:
        shape = tuple(n * num_shards if p else n for n, p in zip(spec.shape, pspec))
        return jax.ShapeDtypeStruct(shape, spec.dtype)

    return jax.tree.map(whole, local, param_specs(config))


def shard_layout(
    x: np.ndarray,
    axes: tuple[str, ...],
    segments,
    num_shards: int,
    shape: tuple[int, ...],
    rules: dict[str, str] = AXIS_RULES,
) -> np.ndarray:
    """A checkpoint-layout param -> its mesh layout of `shape` (see the module docstring):
    vocabulary rows padded with zeros, fused pieces cut shard-major, KV heads repeated; whole
    experts (`rules` EXPERT_PARALLEL_RULES) stay in order, device i's the i-th run of them."""
    cut = [i for i, a in enumerate(axes) if rules.get(a)]
    if num_shards == 1 or not cut:
        return x
    (axis,) = cut
    if axes[axis] == "experts":
        return x
    if axes[axis] == "vocab":
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, shape[axis] - x.shape[axis])
        return np.pad(x, pad)
    if segments is None:
        return x
    bounds = np.cumsum([count * unit for count, unit in segments])[:-1]
    per_shard: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    for (count, _), piece in zip(segments, np.split(x, bounds, axis=axis)):
        if count >= num_shards:
            chunks = np.split(piece, num_shards, axis=axis)
        else:  # fewer KV heads than devices: device s holds head s*K/T
            heads = np.split(piece, count, axis=axis)
            chunks = [heads[s * count // num_shards] for s in range(num_shards)]
        for s, chunk in enumerate(chunks):
            per_shard[s].append(chunk)
    out = np.concatenate([np.concatenate(p, axis=axis) for p in per_shard], axis=axis)
    assert out.shape == shape, (out.shape, shape)
    return out


class ParamPlacer:
    """`place(path, host array)` -> the param on `mesh`, each device given only its slice
    (jax.make_array_from_callback): what CheckpointWeights calls for every param it builds."""

    def __init__(self, config: ModelConfig, mesh: Mesh):
        self._num_shards = mesh.shape[TP_AXIS]
        check_tensor_parallel(config, self._num_shards)
        self._mesh = mesh
        self._axes = param_axes(config)
        self._segments = param_segments(config)
        self._specs = param_specs(config)
        self._shapes = sharded_param_shapes(config, self._num_shards)
        self._is_expert_parallel = config.is_expert_parallel

    def __call__(self, path: str, x: np.ndarray) -> jax.Array:
        sharding = NamedSharding(self._mesh, _lookup(self._specs, path.split(".")))
        if self._mesh.size == 1:  # on CPU the device array may alias the loader's buffer
            return jax.device_put(x, sharding, may_alias=True)
        host = self.host_layout(path, x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def place_quantized(
        self, path: str, fields: dict[str, np.ndarray], experts: bool
    ) -> dict[str, jax.Array]:
        """A quantized weight's fields (quantization/int_weight.py's packed / scale / zero /
        perm / g_idx, fp8_weight.py's values / scale) -> on the mesh, each cut as the float
        param at `path` is: along the same axis, the fused pieces laid out shard-major alike;
        `perm` and `g_idx` along the input axis (with g_idx the scales and zero points whole on
        every device). An expert stack's fields hold [..., E, O, I] where its float param holds
        [..., E, I, O]. ValueError where the input axis is cut and a group or an FP8 block would
        straddle two devices, naming the sizes."""
        keys = path.split(".")
        axes = list(_lookup(self._axes, keys))
        if experts:
            axes[-2:] = axes[-1], axes[-2]
        in_cut = self._rules(keys).get(axes[-1]) is not None and self._num_shards > 1
        if in_cut:
            self._check_input_cut(path, fields)
        whole_groups = "g_idx" in fields
        return {
            k: self._place_field(keys, k, x, axes, experts, whole_groups) for k, x in fields.items()
        }

    def cuts_input(self, path: str, experts: bool) -> bool:
        """Whether the param at `path` is cut along its input axis (row-parallel): an act-order
        weight then takes its g_idx form (quantization/host_weights.py's by_column)."""
        keys = path.split(".")
        axes = _lookup(self._axes, keys)
        in_axis = axes[-2] if experts else axes[-1]
        return self._num_shards > 1 and self._rules(keys).get(in_axis) is not None

    def place_blocks(
        self, path: str, fields: dict[str, np.ndarray], rows: tuple[int, int] | None = None
    ) -> dict[str, jax.Array]:
        """A GGUF weight's block fields (quantization/gguf_blocks.py's split_fields: each
        [..., O, nb, *field_shape], nb blocks along the input axis) -> on the mesh, cut as the
        float param [..., O, I] at `path` is: the output rows laid out shard-major as its fused
        pieces are (the vocabulary padded with zero blocks), or whole blocks a device along the
        input axis. `rows` (start, stop): the fields hold only those output rows of the param
        (a MixedGGUFWeight's piece), laid out by the fused pieces within them. ValueError where
        a block would straddle two devices, or `rows` part a fused piece, naming the sizes."""
        keys = path.split(".")
        axes = tuple(_lookup(self._axes, keys))
        t = self._num_shards
        out_rows = _lookup(self._shapes, keys).shape[-2]
        segments = _lookup(self._segments, keys)
        rules = self._rules(keys)
        if t > 1 and rules.get(axes[-1]) is not None:
            num_in = _lookup(self._shapes, keys).shape[-1]
            num_blocks = next(iter(fields.values())).shape[len(axes) - 1]
            if num_blocks % t:
                raise ValueError(
                    f"{path}: input size {num_in} in {num_blocks} GGUF blocks of "
                    f"{num_in // num_blocks} values cannot be cut over tensor_parallel_size={t} "
                    "devices without a block straddling two of them; choose a "
                    "tensor_parallel_size that divides the blocks"
                )
        is_out_cut = t > 1 and rules.get(axes[-2]) is not None
        if is_out_cut and rows is not None and segments is not None:
            segments, out_rows = _segments_within(path, segments, rows, t)
        placed = {}
        for name, x in fields.items():
            field_axes = axes + (None,) * (x.ndim - len(axes))
            spec = PartitionSpec(*(rules.get(a) for a in field_axes))
            sharding = NamedSharding(self._mesh, spec)
            if self._mesh.size == 1:
                placed[name] = jax.device_put(x, sharding, may_alias=True)
                continue
            shape = (*x.shape[: len(axes) - 2], out_rows, *x.shape[len(axes) - 1 :])
            host = shard_layout(x, field_axes, segments, t, shape, rules)
            placed[name] = jax.make_array_from_callback(
                host.shape, sharding, lambda index, host=host: host[index]
            )
        return placed

    def output_rows_unit(self, path: str, experts: bool) -> int | None:
        """The rows every chunk the mesh lays out of the param at `path` holds a multiple of,
        where its output axis is cut (None where it is not): an FP8 weight whose block rows do
        not divide it is given a scale a row, so that no block is split."""
        keys = path.split(".")
        axes = _lookup(self._axes, keys)
        out = -1 if experts else -2
        if self._num_shards == 1 or self._rules(keys).get(axes[out]) is None:
            return None
        t = self._num_shards
        segments = _lookup(self._segments, keys)
        if segments is None:
            return _lookup(self._shapes, keys).shape[out] // t
        return math.gcd(*(count // t * unit if count >= t else unit for count, unit in segments))

    def _place_field(
        self, keys, field: str, x: np.ndarray, axes: list, experts: bool, whole_groups: bool
    ):
        """whole_groups: the scales and zero points stay whole along their group axis (each
        device's columns, act-order's g_idx form, may be in any group)."""
        per_column = field in ("perm", "g_idx")
        axes = axes[:-2] + axes[-1:] if per_column else axes
        if field in ("scale", "zero") and (x.shape[-1] == 1 or whole_groups):
            axes = axes[:-1] + [None]  # one scale a row: every device's columns use it whole
        rules = self._rules(keys)
        sharding = NamedSharding(self._mesh, PartitionSpec(*(rules.get(a) for a in axes)))
        out_cut = not per_column and rules.get(axes[-2]) is not None
        if self._mesh.size == 1:
            return jax.device_put(x, sharding, may_alias=True)
        host = x
        if out_cut and self._num_shards > 1:
            whole = _lookup(self._shapes, keys).shape
            shape = (*x.shape[:-2], whole[-1] if experts else whole[-2], x.shape[-1])
            segments = _lookup(self._segments, keys)
            host = shard_layout(x, tuple(axes), segments, self._num_shards, shape, rules)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _check_input_cut(self, path: str, fields: dict[str, np.ndarray]) -> None:
        """A row-parallel quantized weight must split into whole groups (FP8: whole blocks)
        per device (or keep its scales whole on every device: one a row, or act-order's g_idx
        form), its packed bytes into whole 32-column runs."""
        t = self._num_shards
        if "values" in fields:  # FP8: values [..., I], scale [..., I / bi]
            num_in, num_blocks = fields["values"].shape[-1], fields["scale"].shape[-1]
            block = -(-num_in // num_blocks)
            ok = num_blocks == 1 or (num_in % t == 0 and (num_in // t) % block == 0)
            what = f"FP8 blocks of {block} columns"
        else:
            num_bytes, num_groups = fields["packed"].shape[-1], fields["scale"].shape[-1]
            whole_groups = num_groups == 1 or "g_idx" in fields
            ok = (whole_groups or num_groups % t == 0) and num_bytes % (16 * t) == 0
            what = f"{num_groups} groups ({num_bytes} packed bytes a row)"
            num_in = None
        if not ok:
            size = f"input size {num_in} in " if num_in else ""
            raise ValueError(
                f"{path}: {size}{what} cannot be cut over tensor_parallel_size={t} devices "
                "without a group straddling two of them; choose a tensor_parallel_size that "
                "divides the groups"
            )

    def host_layout(self, path: str, x: np.ndarray) -> np.ndarray:
        """A checkpoint-layout param -> its mesh layout, still on the host (shard_layout)."""
        keys = path.split(".")
        axes, segments, shape = (
            _lookup(t, keys) for t in (self._axes, self._segments, self._shapes)
        )
        return shard_layout(x, axes, segments, self._num_shards, shape.shape, self._rules(keys))

    def _rules(self, keys: list[str]) -> dict[str, str]:
        """The rules that place the param at `keys` (`axis_rules`)."""
        return axis_rules(_lookup(self._axes, keys), self._is_expert_parallel)


def placer(config: ModelConfig, mesh: Mesh | None) -> ParamPlacer | None:
    """What a loader places `config`'s params with on `mesh` (None: JAX's default device)."""
    return None if mesh is None else ParamPlacer(config, mesh)


def _segments_within(
    path: str, segments: tuple[tuple[int, int], ...], rows: tuple[int, int], num_shards: int
) -> tuple[tuple[tuple[int, int], ...], int]:
    """The fused pieces (Segments) that output rows [start, stop) of the param at `path` hold,
    and the rows they take laid out over `num_shards` devices (a KV piece of fewer heads than
    devices repeated on each). ValueError where the rows part a piece."""
    start, stop = rows
    within, first = [], 0
    for count, unit in segments:
        last = first + count * unit
        if start <= first and last <= stop:
            within.append((count, unit))
        first = last
    if sum(count * unit for count, unit in within) != stop - start:
        raise ValueError(
            f"{path}: its rows [{start}, {stop}), in a GGUF format of their own, part one of "
            f"its fused pieces {segments} (heads or columns, each rows): they cannot be laid "
            f"out over tensor_parallel_size={num_shards} devices"
        )
    return tuple(within), sum(max(count, num_shards) * unit for count, unit in within)


def _lookup(tree: dict, keys: list[str]):
    for key in keys:
        tree = tree[key]
    return tree
