"""Integer weights of 4 or 8 bits with a scale (and a zero point) per group of input columns: the
layout every pre-quantized integer checkpoint (compressed-tensors, GPTQ, AWQ) is repacked into at
load (model_loader/quantized_tensors.py), kept packed on the device and dequantized inside
the jitted step.

A [..., O, I] weight of `bits` b and group size g holds:
- packed u8[..., O, I * b / 8]: unsigned values q in [0, 2^b). 4 bits: in each run of 32 input
  columns c..c+31, byte c/2 + j holds column c + j in its low nibble and c + 16 + j in its high
  one (GGUF's order, which a SIMD kernel unpacks with one shift and one mask). 8 bits: a byte a
  column.
- scale [..., O, I / g], in the checkpoint's scale dtype (float16, bfloat16 or float32);
- zero: None (symmetric: 2^(b-1)) or i16[..., O, I / g], the group's zero point, in q's range
  (GPTQ's v1 convention, stored minus one, reaches 2^b: hence 16 bits);
- perm: None, or i32[..., I] for GPTQ's act-order: the columns are stored sorted by group, and
  the step multiplies x[..., perm] (x's columns in that order) by them;
- g_idx: None, or i32[..., I], act-order's other form, for an expert stack (whose grouped
  matmul takes columns in order) and where tensor parallelism cuts the input axis (a device's
  columns hold groups of every device's): columns in checkpoint order, each column's group
  given, the scales and zero points whole on every device.

The value of column i of row o is w = (q - z) * s with z, s the entries of its group, rounded
to the scale dtype (`rounded`) and then converted to the model dtype: what compressed_tensors'
decompression and GPTQModel / AutoAWQ's dequantization compute, bit for bit (`dequantize`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.quantization import cpu_int_group
from jvllm.quantization.dot import dot_rows
from kernels_pallas import dequant_matmul

NIBBLE_RUN = 32  # a 4-bit row is packed in runs of this many columns


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IntWeight:
    """See the module docstring. dtype: the model dtype the values are used in; experts: the
    weight is a MoE's expert stack [..., E, O, I] that layers/moe.py reads as [..., E, I, O]
    (`grouped`); g_idx: see the module docstring; layer: None, or i32[] when the fields are
    stacked [L, ...] and the weight is layer `layer` of them."""

    packed: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    perm: jax.Array | None
    bits: int = dataclasses.field(metadata={"static": True})
    group_size: int = dataclasses.field(metadata={"static": True})
    dtype: str = dataclasses.field(metadata={"static": True})
    experts: bool = dataclasses.field(default=False, metadata={"static": True})
    g_idx: jax.Array | None = None
    layer: jax.Array | None = None

    def at_layer(self, layer: jax.Array) -> IntWeight:
        """Layer i32[] of a stacked weight, without slicing its fields."""
        return dataclasses.replace(self, layer=layer)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float param's shape: [..., O, I], an expert stack's [..., E, I, O]."""
        lead = self.packed.shape[:-1] if self.layer is None else self.packed.shape[1:-1]
        num_in = self.packed.shape[-1] * 8 // self.bits
        return (*lead[:-1], num_in, lead[-1]) if self.experts else (*lead, num_in)

    @property
    def nbytes(self) -> int:
        fields = (self.packed, self.scale, self.zero, self.perm, self.g_idx)
        return sum(f.nbytes for f in fields if f is not None)

    def __getitem__(self, key):
        """`param[...]` (how the layers read a weight) gives the weight itself."""
        if key is not Ellipsis:
            raise TypeError("a quantized weight is read whole (weight[...]); use dense()")
        return self

    def _own(self, x: jax.Array | None) -> jax.Array | None:
        """This weight's own slice of a field: a stacked one's layer."""
        if x is None or self.layer is None:
            return x
        return jax.lax.dynamic_index_in_dim(x, self.layer, 0, False)

    def dequantize(self) -> jax.Array:
        """-> [..., O, I] in the model dtype, columns in stored order (see `perm`)."""
        fields = self._own(self.packed), self._own(self.scale), self._own(self.zero)
        if self.g_idx is not None:
            return dequantize_by_column(*fields, self._own(self.g_idx), self.bits).astype(
                self.dtype
            )
        return dequantize(*fields, self.bits).astype(self.dtype)

    def dequantize_in_checkpoint_order(self) -> jax.Array:
        """`dequantize` with act-order's sorted columns put back where the checkpoint had them:
        for a caller that multiplies the weight itself (layers/mla.py absorbs kv_b)."""
        w = self.dequantize()
        perm = self._own(self.perm)  # stored column j is the checkpoint's column perm[j]
        return w if perm is None else jnp.take(w, jnp.argsort(perm), axis=-1)

    def dense(self, x: jax.Array) -> jax.Array:
        """x [..., I] @ weight [O, I].T -> f32[..., O]. On a GPU kernels_pallas' dequantizing
        matmul reads the packed bytes once, a stacked layer where it lies; on CPU the native
        kernel (cpu_int_group.py) does, its values those of `dequantize`. Elsewhere the layer
        is dequantized in the step: 4-bit weights as their two nibble planes (`_nibble_planes`),
        each meeting its half of x's columns, one row on CPU by multiplying and reducing (so
        that XLA fuses the dequantization into the product and reads only the packed bytes),
        more rows in two matmuls."""
        perm = self._own(self.perm)
        if perm is not None:
            x = jnp.take(x, perm, axis=-1)
        if self.g_idx is not None:  # scales gathered per column: no kernel reads that
            return dot_rows(x, self.dequantize())
        num_rows = x.size // x.shape[-1]
        group_size = self._local_group_size()
        if pallas_dequant() and group_size % (32 if self.bits == 4 else 16) == 0:
            rows = x.reshape(num_rows, -1).astype(self.dtype)
            y = dequant_matmul.int_matmul(
                rows,
                self.packed,
                self.scale,
                self.zero,
                bits=self.bits,
                group_size=group_size,
                layer=self.layer,
            )
            return y.reshape(*x.shape[:-1], -1)
        if cpu_int_group.supports(self.dtype, self.bits, group_size, self.scale.dtype):
            stacked = self.layer is not None
            fields = [self.packed, self.scale, self.zero]
            fields = [f if stacked or f is None else f[None] for f in fields]  # [L, ...]
            rows = x.reshape(num_rows, -1)
            layer = self.layer if stacked else 0
            y = cpu_int_group.dense(rows, *fields, layer, self.bits, group_size, self.dtype)
            return y.reshape(*x.shape[:-1], -1)
        if self.bits == 8 or self.group_size % 16:
            return dot_rows(x, self.dequantize())
        # 4 bits: the weight in its two nibble planes, x's columns split to match.
        rows = x.reshape(num_rows, -1, 2, NIBBLE_RUN // 2)  # [M, R, 2, 16]
        halves = self._nibble_planes()  # [O, R, 16] each
        if num_rows == 1 and jax.default_backend() == "cpu":
            xs = rows[0].astype(self.dtype).astype(jnp.float32)  # [R, 2, 16]
            y = sum((w * xs[:, h]).sum((-1, -2)) for h, w in enumerate(halves))
            return y.reshape(*x.shape[:-1], -1)
        y = sum(
            dot_rows(rows[:, :, h].reshape(num_rows, -1), w.reshape(w.shape[0], -1))
            for h, w in enumerate(halves)
        )
        return y.reshape(*x.shape[:-1], -1)

    def _local_group_size(self) -> int:
        """The columns a scale covers here: a device's own under tensor parallelism, where a
        per-channel scale kept whole covers the device's columns."""
        return self.packed.shape[-1] * 8 // self.bits // self.scale.shape[-1]

    def _nibble_planes(self) -> tuple[jax.Array, jax.Array]:
        """This layer's 4-bit weight as its two nibble planes, in the model dtype: [O, R, 16]
        each (R runs of 32 columns; plane 0 holds a run's columns 0-15, plane 1 its 16-31), so
        that XLA never interleaves them: unpacking into column order (a concatenation in the
        fusion) ran the SmolLM2 [1536, 576] layer 9x slower inside the layer scan (1.3 against
        0.15 ms). A stacked layer's fields are copied out first (packed_weight.py's GGUF weights
        do the same, for the same reason)."""
        fields = self._own(self.packed), self._own(self.scale), self._own(self.zero)
        if self.layer is not None:
            fields = jax.lax.optimization_barrier(fields)
        packed, scale, zero = fields
        num_out, num_runs = packed.shape[0], packed.shape[1] // (NIBBLE_RUN // 2)
        runs = packed.reshape(num_out, num_runs, NIBBLE_RUN // 2).astype(jnp.int32)
        # Each plane's 16 columns of a run lie in one group (of 16 or more columns).
        starts = np.arange(num_runs)[:, None] * NIBBLE_RUN + np.arange(2) * (NIBBLE_RUN // 2)
        groups = starts // self.group_size  # [R, 2]
        planes = []
        for half, q in enumerate((runs & 15, runs >> 4)):  # [O, R, 16] each
            s = scale[:, groups[:, half]].astype(jnp.float32)[..., None]  # [O, R, 1]
            z = 1 << (self.bits - 1) if zero is None else zero[:, groups[:, half], None]
            w = rounded((q - z).astype(jnp.float32) * s, scale.dtype)
            planes.append(w.astype(self.dtype))
        return planes[0], planes[1]

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """rows [M, I] grouped by expert (group_sizes i32[E]) @ expert e's [I, O] -> f32[M, O]:
        this layer's experts dequantized in the step, then one ragged_dot. An act-order stack
        comes in its g_idx form (columns in checkpoint order: models/weights.py), so that no
        step has to put sorted columns back."""
        w = self.dequantize()  # [E, O, I]
        return jax.lax.ragged_dot(
            rows.astype(self.dtype),
            jnp.swapaxes(w, -1, -2),
            group_sizes,
            preferred_element_type=jnp.float32,
        )


def pallas_dequant() -> bool:
    """Whether this backend runs kernels_pallas' dequantizing matmuls: a GPU's, unless
    JVLLM_PALLAS_DEQUANT=0 (XLA's dequantize-then-matmul instead)."""
    return jax.default_backend() == "gpu" and os.environ.get("JVLLM_PALLAS_DEQUANT", "1") != "0"


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """u8[..., I * bits / 8] -> i32[..., I]: the unsigned values, in column order."""
    if bits == 8:
        return packed.astype(jnp.int32)
    runs = packed.reshape(*packed.shape[:-1], -1, NIBBLE_RUN // 2)  # [..., I/32, 16]
    values = jnp.concatenate([runs & 15, runs >> 4], axis=-1)  # [..., I/32, 32]
    return values.reshape(*packed.shape[:-1], -1).astype(jnp.int32)


def dequantize(packed: jax.Array, scale: jax.Array, zero: jax.Array | None, bits: int) -> jax.Array:
    """The values (q - z) * s of the module docstring -> [..., O, I] in scale's dtype."""
    q = unpack(packed, bits)  # [..., O, I]
    num_groups = scale.shape[-1]
    q = q.reshape(*q.shape[:-1], num_groups, -1)  # [..., O, G, g]
    z = jnp.int32(1 << (bits - 1)) if zero is None else zero.astype(jnp.int32)[..., None]
    w = (q - z).astype(jnp.float32) * scale.astype(jnp.float32)[..., None]  # exact
    return rounded(w.reshape(*w.shape[:-2], -1), scale.dtype)


def rounded(x: jax.Array, dtype) -> jax.Array:
    """f32 x rounded to `dtype` (to nearest even), as the dtype's own arithmetic would give it:
    XLA may keep a bfloat16 / float16 product at float32 precision inside a fusion (excess
    precision), so the step's values would not be the format's reference ones. reduce_precision
    flushes what falls below float16's normal range, which float16 keeps as subnormals: those
    are rounded to its subnormal step here."""
    info = jnp.finfo(dtype)
    if info.bits == 32:
        return x
    y = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp == 5:  # float16; bfloat16's subnormals are float32's, never a weight's
        step = float(info.smallest_subnormal)
        subnormal = jnp.round(x / step) * step  # exact: a power of two, then half to even
        y = jnp.where(jnp.abs(x) < float(info.smallest_normal), subnormal, y)
    return y.astype(dtype)


def dequantize_by_column(
    packed: jax.Array, scale: jax.Array, zero: jax.Array | None, g_idx: jax.Array, bits: int
) -> jax.Array:
    """`dequantize` where column i's scale and zero point are its group g_idx[i]'s (i32[..., I]
    over packed's columns) -> [..., O, I] in scale's dtype."""
    q = unpack(packed, bits)  # [..., O, I]
    columns = jnp.broadcast_to(g_idx[..., None, :], q.shape)  # [..., O, I]
    s = jnp.take_along_axis(scale, columns, axis=-1).astype(jnp.float32)
    z = 1 << (bits - 1)
    if zero is not None:
        z = jnp.take_along_axis(zero, columns, axis=-1).astype(jnp.int32)
    return rounded((q - z).astype(jnp.float32) * s, scale.dtype)


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values [..., I] (each < 2^bits) -> u8 packed as the module docstring says (the
    load-time inverse of `unpack`)."""
    values = np.asarray(values, np.uint8)
    if bits == 8:
        return values
    num_in = values.shape[-1]
    if num_in % NIBBLE_RUN:
        raise ValueError(
            f"a 4-bit weight's input size must be a multiple of {NIBBLE_RUN}, got {num_in}"
        )
    runs = values.reshape(*values.shape[:-1], -1, 2, NIBBLE_RUN // 2)  # [..., I/32, 2, 16]
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*values.shape[:-1], num_in // 2)
