"""Params kept quantized on the device as the checkpoint stores them: GGUF tensors of block
formats that stay packed become a GGUFWeight of their blocks (a MixedGGUFWeight where their
formats differ), and a pre-quantized checkpoint's matmul weights an IntWeight / FP8Weight, each
cut over the devices as the float param would be. CheckpointWeights (weights.py) tries these
first, and reads a param as floats where they give None."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from jvllm.models.host_arrays import aligned_copy
from jvllm.quantization import host_weights
from jvllm.quantization.gguf_blocks import PACKED_QTYPES, split_fields
from jvllm.quantization.host_weights import HostFP8, HostInt, HostQuantized
from jvllm.quantization.mixed_weight import MixedGGUFWeight
from jvllm.quantization.packed_weight import GGUFWeight

# `place`, below: CheckpointWeights' placer (weights.py's WholePlacer, or tensor parallelism's
# ParamPlacer), whose place_blocks / place_quantized put a weight's fields on the devices.


def packed_weight(
    place, path: str, spec: jax.ShapeDtypeStruct, sources: list[list], stack: bool
) -> GGUFWeight | MixedGGUFWeight | None:
    """The param at `path` as a GGUFWeight of the lazy GGUF tensors `sources` ([L][pieces],
    one row of pieces when not `stack`) if they can stay packed, a MixedGGUFWeight where their
    formats differ; None where they cannot."""
    qtypes = {s.qtype for names in sources for s in names}
    if not qtypes <= set(PACKED_QTYPES):
        return None
    shapes = [[s.shape for s in names] for names in sources]
    rows = [sum(shape[0] for shape in layer) for layer in shapes]
    expected = spec.shape[1:] if stack else spec.shape
    if any(
        r != expected[0] or {s[1:] for s in layer} != {expected[1:]}
        for r, layer in zip(rows, shapes)
    ):
        return None  # _mismatch's message comes from the float path
    if len(qtypes) > 1:  # only a stacked param has pieces or layers to differ
        return _mixed(place, path, sources, str(spec.dtype))
    blocks = np.stack([np.concatenate([s.blocks() for s in names]) for names in sources])
    blocks = blocks if stack else blocks[0]
    return _packed(place, path, blocks, qtypes.pop(), str(spec.dtype))


def quantized_weight(
    quantized: Callable[[str], HostQuantized | None],
    place,
    path: str,
    spec: jax.ShapeDtypeStruct,
    layer_names: list,
    experts: bool,
):
    """The param at `path` as the IntWeight / FP8Weight of the pre-quantized tensors
    `layer_names` ([L][pieces], an expert stack's [L][E][pieces]) if all are quantized alike
    and fit `spec`, else None. `quantized(name)`: the weight `name` in the device layout, None
    where it is stored as floats."""

    def fused(names: list[str]) -> HostQuantized | None:
        pieces = [quantized(n) for n in names]
        if any(p is None for p in pieces):
            return None
        return host_weights.concat_rows(pieces)

    def layer(names: list) -> HostQuantized | None:
        if not experts:
            return fused(names)
        per_expert = [fused(n) for n in names]
        if any(p is None for p in per_expert):
            return None
        return host_weights.stack(per_expert)

    layers = [layer(names) for names in layer_names]
    if any(p is None for p in layers):
        return None
    host = host_weights.stack(layers)
    if host is None or host.shape(experts) != tuple(spec.shape):
        return None  # _mismatch's message comes from the float path
    if isinstance(host, HostInt) and (experts or place.cuts_input(path, experts)):
        # Act-order's sorted columns: a grouped matmul reads experts in column order, and
        # a cut along the input axis would spread each group over the devices.
        host = host.by_column()
    unit = place.output_rows_unit(path, experts)
    if isinstance(host, HostFP8) and unit is not None and unit % host.block[0]:
        host = host.per_row()  # the mesh's cut would split a block of rows
    return host_weights.to_device(
        host, functools.partial(_place_quantized, place, path, experts), str(spec.dtype), experts
    )


def _place_quantized(place, path: str, experts: bool, fields: dict) -> dict:
    """A quantized weight's fields on the param's device(s): cut as the float param would
    be under tensor parallelism (the placer's place_quantized)."""
    fields = {k: aligned_copy(v) for k, v in fields.items()}
    return place.place_quantized(path, fields, experts)


def _packed(
    place, path: str, blocks: np.ndarray, qtype, dtype: str, rows: tuple[int, int] | None = None
) -> GGUFWeight:
    """blocks [(L,) O, nb] of `qtype` (a structured array) as a GGUFWeight on the param's
    device(s): under tensor parallelism cut as the float param would be (the placer's
    place_blocks; `rows`: the param's output rows the blocks hold, where not all)."""
    fields = {k: aligned_copy(v) for k, v in split_fields(blocks, qtype).items()}
    placed = place.place_blocks(path, fields, rows)  # [(L,) O, nb, ...] each
    return GGUFWeight(placed, int(qtype), dtype)


def _mixed(place, path: str, sources: list[list], dtype: str) -> MixedGGUFWeight:
    """sources [L][pieces] of several formats: neighbouring pieces whose layers agree on
    their formats form one piece, and each piece one stacked GGUFWeight per format."""
    formats = [tuple(layer[p].qtype for layer in sources) for p in range(len(sources[0]))]
    runs = [[0]]
    for p in range(1, len(formats)):
        if formats[p] == formats[runs[-1][0]]:
            runs[-1].append(p)
        else:
            runs.append([p])
    pieces, members = [], []
    start = 0
    for run in runs:
        rows = (start, start + sum(sources[0][p].shape[0] for p in run))
        start = rows[1]
        layer_formats = formats[run[0]]
        groups = [
            tuple(i for i, q in enumerate(layer_formats) if q == qtype)
            for qtype in dict.fromkeys(layer_formats)  # in order of first use
        ]
        weights = []
        for layers in groups:
            blocks = [np.concatenate([sources[i][p].blocks() for p in run]) for i in layers]
            qtype = layer_formats[layers[0]]
            weights.append(_packed(place, path, np.stack(blocks), qtype, dtype, rows))
        pieces.append(tuple(weights))
        members.append(tuple(groups))
    return MixedGGUFWeight(tuple(pieces), tuple(members))
