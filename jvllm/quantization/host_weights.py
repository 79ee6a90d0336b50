"""A pre-quantized weight on the host, in the device layout (int_weight.py, fp8_weight.py), as the
checkpoint readers (model_loader/quantized_tensors.py) give it: what the loader fuses (q|k|v
along the output axis), stacks over layers and places on the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

from jvllm.quantization.fp8_weight import FP8Weight, dequantize_blocks
from jvllm.quantization.int_weight import IntWeight, dequantize, pack, unpack

# A weight's fields {name: host array} -> {name: on its device(s)}.
Place = Callable[[dict[str, np.ndarray]], dict[str, object]]


@dataclasses.dataclass(frozen=True)
class HostInt:
    """packed u8[..., O, I * bits / 8], scale [..., O, G], zero i16[..., O, G] or None,
    perm i32[..., I] or None, g_idx i32[..., I] or None: IntWeight's fields (int_weight.py)."""

    packed: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    perm: np.ndarray | None
    bits: int
    group_size: int
    g_idx: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self.packed.shape[-2]

    def by_column(self) -> HostInt:
        """Act-order's sorted columns put back in checkpoint order, each column's group given
        (IntWeight's g_idx form, for a cut along the input axis)."""
        if self.perm is None:
            return self
        inverse = np.argsort(self.perm, axis=-1)  # [..., I]: where column i is stored
        values = np.asarray(unpack(self.packed, self.bits))  # [..., O, I]
        values = np.take_along_axis(values, inverse[..., None, :], axis=-1)
        g_idx = (inverse // self.group_size).astype(np.int32)
        return dataclasses.replace(self, packed=pack(values, self.bits), perm=None, g_idx=g_idx)

    def shape(self, experts: bool = False) -> tuple[int, ...]:
        """The float param's shape (an expert stack's [..., E, I, O])."""
        *lead, rows, num_bytes = self.packed.shape
        return _param_shape((*lead, rows, num_bytes * 8 // self.bits), experts)

    def key(self) -> tuple:
        """What pieces and layers must share to live in one IntWeight."""
        return ("int", self.bits, self.group_size, self.packed.shape[-1])

    def dequantize(self) -> np.ndarray:
        """f32[..., O, I] in the checkpoint's column order (for a param that stays float)."""
        w = np.asarray(dequantize(self.packed, self.scale, self.zero, self.bits), np.float32)
        if self.perm is None:
            return w
        return np.take_along_axis(w, np.argsort(self.perm, axis=-1)[..., None, :], axis=-1)


@dataclasses.dataclass(frozen=True)
class HostFP8:
    """values float8_e4m3fn[..., O, I], scale [..., O / bo, I / bi] (rounded up), block;
    dynamic_activations: the scheme quantizes activations to fp8 per token (FP8Weight's)."""

    values: np.ndarray
    scale: np.ndarray
    block: tuple[int, int]
    dynamic_activations: bool = False

    @property
    def rows(self) -> int:
        return self.values.shape[-2]

    def shape(self, experts: bool = False) -> tuple[int, ...]:
        return _param_shape(self.values.shape, experts)

    def key(self) -> tuple:
        return ("fp8", self.values.shape[-1])

    def per_row(self) -> HostFP8:
        """The same weight with a scale per row (bo = 1): what lets pieces whose row counts are
        not multiples of bo be fused."""
        if self.block[0] == 1:
            return self
        scale = np.repeat(self.scale, self.block[0], axis=-2)[..., : self.rows, :]
        return dataclasses.replace(self, scale=scale, block=(1, self.block[1]))

    def dequantize(self) -> np.ndarray:
        return np.asarray(dequantize_blocks(self.values, self.scale, self.block), np.float32)


HostQuantized = HostInt | HostFP8


def concat_rows(pieces: list[HostQuantized]) -> HostQuantized | None:
    """Pieces of one fused weight (q, k, v) concatenated along their output axis; None where they
    cannot share one weight (different formats, bit widths or groups, or act-order columns
    sorted differently)."""
    if len(pieces) == 1:
        return pieces[0]
    if len({p.key() for p in pieces}) > 1:
        return None
    if isinstance(pieces[0], HostFP8):
        # Per-tensor q, k and v scales, or blocks that a piece ends inside, become per row.
        if len({p.block for p in pieces}) > 1 or any(p.rows % p.block[0] for p in pieces[:-1]):
            pieces = [p.per_row() for p in pieces]
        if len({p.block for p in pieces}) > 1:
            return None
        scale = _common_dtype([p.scale for p in pieces])
        values = _cat([p.values for p in pieces])
        return dataclasses.replace(pieces[0], values=values, scale=_cat(scale))
    perms = [p.perm for p in pieces]
    if any(p is None for p in perms) != all(p is None for p in perms) or (
        perms[0] is not None and any(not np.array_equal(perms[0], p) for p in perms)
    ):
        return None
    first = pieces[0]
    zeros = None
    if any(p.zero is not None for p in pieces):
        zeros = [_zero_or_symmetric(p) for p in pieces]
        zeros = _cat(zeros)
    scale = _cat(_common_dtype([p.scale for p in pieces]))
    return HostInt(
        _cat([p.packed for p in pieces]), scale, zeros, perms[0], first.bits, first.group_size
    )


def stack(layers: list[HostQuantized]) -> HostQuantized | None:
    """One weight's layers (or a layer's experts) stacked on a new first axis; None where they
    differ in format."""
    if len({(p.key(), type(p)) for p in layers}) > 1:
        return None
    if isinstance(layers[0], HostFP8):
        if len({p.block for p in layers}) > 1:
            layers = [p.per_row() for p in layers]
        if len({(p.block, p.scale.shape) for p in layers}) > 1:
            return None
        scale = np.stack(_common_dtype([p.scale for p in layers]))
        return dataclasses.replace(
            layers[0], values=np.stack([p.values for p in layers]), scale=scale
        )
    zero = None
    if any(p.zero is not None for p in layers):
        zero = np.stack([_zero_or_symmetric(p) for p in layers])
    perm = None
    perms = [p.perm for p in layers if p.perm is not None]
    if perms:  # an expert (or layer) that GPTQ left in column order keeps it: the identity
        identity = np.broadcast_to(np.arange(perms[0].shape[-1], dtype=np.int32), perms[0].shape)
        perm = np.stack([identity if p.perm is None else p.perm for p in layers])
    first = layers[0]
    return HostInt(
        np.stack([p.packed for p in layers]),
        np.stack(_common_dtype([p.scale for p in layers])),
        zero,
        perm,
        first.bits,
        first.group_size,
    )


def to_device(host: HostQuantized, place: Place, dtype: str, experts: bool = False):
    """The IntWeight / FP8Weight of `host`, its fields put on their device(s) by `place`."""
    if isinstance(host, HostFP8):
        f = place({"values": host.values, "scale": host.scale})
        return FP8Weight(
            f["values"], f["scale"], host.block, dtype, experts, host.dynamic_activations
        )
    fields = {
        "packed": host.packed,
        "scale": host.scale,
        "zero": host.zero,
        "perm": host.perm,
        "g_idx": host.g_idx,
    }
    f = place({k: v for k, v in fields.items() if v is not None})
    return IntWeight(
        f["packed"],
        f["scale"],
        f.get("zero"),
        f.get("perm"),
        host.bits,
        host.group_size,
        dtype,
        experts,
        f.get("g_idx"),
    )


def int_weight(
    values: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray | None,
    bits: int,
    group_size: int | None,
    g_idx: np.ndarray | None = None,
) -> HostInt:
    """A HostInt from unsigned values [O, I] (< 2^bits), scale [O, G], zero [O, G] (None:
    symmetric) and act-order's g_idx i32[I] (each column's group, None: column i in group
    i // group_size). A group size that does not divide I (the last group shorter, as GPTQ
    writes SmolLM2's 576 columns in groups of 128) is restated as
    the largest that divides both, each scale and zero point repeated: the same values.
    ValueError where the sizes do not fit the layout."""
    num_out, num_in = values.shape
    group_size = group_size or num_in
    num_groups = -(-num_in // group_size)
    if scale.shape != (num_out, num_groups):
        raise ValueError(
            f"a weight [{num_out}, {num_in}] with group_size {group_size} needs scales "
            f"[{num_out}, {num_groups}], got {list(scale.shape)}"
        )
    if zero is not None and zero.shape != scale.shape:
        raise ValueError(
            f"a weight [{num_out}, {num_in}] with scales {list(scale.shape)} needs zero points "
            f"of that shape, got {list(zero.shape)}: is the checkpoint's zero-point packing "
            "the format's?"
        )
    in_order = np.arange(num_in) // group_size
    if g_idx is not None and np.array_equal(g_idx, in_order):
        g_idx = None
    perm = None
    if g_idx is not None:
        counts = np.bincount(g_idx, minlength=num_groups)
        if len(counts) != num_groups or (counts != group_size).any():
            raise ValueError(
                f"g_idx gives groups of {sorted(set(counts.tolist()))} columns where the "
                f"group size is {group_size} of {num_in}; jvllm needs act-order groups of "
                "equal size"
            )
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)
        values = values[:, perm]
    if num_in % group_size:
        finer = math.gcd(num_in, group_size)
        index = np.arange(num_in // finer) * finer // group_size  # each finer group's group
        scale = scale[:, index]
        zero = None if zero is None else zero[:, index]
        group_size = finer
    zero = None if zero is None else zero.astype(np.int16)
    return HostInt(pack(values, bits), scale, zero, perm, bits, group_size)


def fp8_weight(
    values: np.ndarray,
    scale: np.ndarray,
    block: tuple[int, int] | None,
    dynamic_activations: bool = False,
) -> HostFP8:
    """A HostFP8 from e4m3 values [O, I] and a scale of `block` (None: one for the tensor, a
    scale [1, 1]); a per-channel scale [O] / [O, 1] has block (1, I)."""
    num_out, num_in = values.shape
    values = values.view(ml_dtypes.float8_e4m3fn)
    if block is None:
        block = (num_out, num_in) if scale.size == 1 else (1, num_in)
    grid = (-(-num_out // block[0]), -(-num_in // block[1]))
    if scale.size != grid[0] * grid[1]:
        raise ValueError(
            f"an FP8 weight [{num_out}, {num_in}] with blocks {list(block)} needs {list(grid)} "
            f"scales, got {list(scale.shape)}"
        )
    return HostFP8(values, scale.reshape(grid), tuple(block), dynamic_activations)


def _param_shape(shape: tuple[int, ...], experts: bool) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if experts else tuple(shape)


def _zero_or_symmetric(p: HostInt) -> np.ndarray:
    if p.zero is not None:
        return p.zero
    return np.full(p.scale.shape, 1 << (p.bits - 1), np.int16)


def _common_dtype(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The arrays in one dtype: theirs if they share it, else float32 (exact for them all)."""
    if len({a.dtype for a in arrays}) == 1:
        return arrays
    return [a.astype(np.float32) for a in arrays]


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays, axis=-2)
