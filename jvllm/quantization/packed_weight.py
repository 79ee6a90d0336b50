"""A weight kept quantized on the device, used where the model would use its float array.

`GGUFWeight` holds a [..., O, I] weight as GGUF blocks (quantization/gguf_blocks.py). It is a
pytree whose leaves are the blocks' fields, so it travels in the params pytree through jit, the
layer scan and donation like any array. The layers reach it through `dense` and the
embedding's row lookup; both dequantize inside the jitted step, so a step reads the packed
bytes. In the layer scan a weight keeps its stacked fields and the layer's index (`at_layer`):
the CPU kernel (cpu_gguf.py) reads that layer where it lies, and the other paths slice it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from gguf.constants import GGMLQuantizationType as Q

from jvllm.quantization import cpu_gguf
from jvllm.quantization.dot import dot_rows
from jvllm.quantization.gguf_blocks import BLOCK_FORMATS, Fields


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GGUFWeight:
    """fields: each block field as [..., O, nb, *field_shape]; qtype: the block format;
    dtype: the model dtype the values are used in (float32 keeps them exactly); layer: None,
    or i32[] when the fields are [L, O, nb, ...] and the weight is layer `layer` of them."""

    fields: Fields
    qtype: int = dataclasses.field(metadata={"static": True})
    dtype: str = dataclasses.field(metadata={"static": True})
    layer: jax.Array | None = None

    def at_layer(self, layer: jax.Array) -> GGUFWeight:
        """Layer i32[] of a weight stacked [L, O, I], without slicing its fields."""
        return dataclasses.replace(self, layer=layer)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [..., O, I]."""
        fmt = BLOCK_FORMATS[Q(self.qtype)]
        first = self.fields[fmt.fields.names[0]]
        lead = first.shape[: first.ndim - len(fmt.fields[0].shape)]  # [..., O, nb]
        lead = lead if self.layer is None else lead[1:]
        return (*lead[:-1], lead[-1] * fmt.block_size)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields.values())

    def _own_fields(self, keep_as_is: bool = False) -> Fields:
        """The fields of this weight alone: a stacked one's layer sliced out. keep_as_is: copy
        the slice as it is, so that what reads it cannot fuse the slicing (see `dense`)."""
        if self.layer is None:
            return self.fields
        fields = {
            k: jax.lax.dynamic_index_in_dim(v, self.layer, keepdims=False)
            for k, v in self.fields.items()
        }
        return jax.lax.optimization_barrier(fields) if keep_as_is else fields

    def __getitem__(self, key):
        """`param[...]` (how the layers read a weight) gives the weight itself."""
        if key is not Ellipsis:
            raise TypeError("a GGUF weight is read whole (weight[...]); use rows() or dense()")
        return self

    def dequantize(self, rows: jax.Array | None = None) -> jax.Array:
        """-> f32[..., O, I], or f32[T, I] of the rows i32[T] of an [O, I] weight: exactly the
        values gguf.quants.dequantize gives."""
        values = self._blocks(rows)  # [..., nb, block_size]
        return values.reshape(*values.shape[:-2], -1)

    def _blocks(self, rows: jax.Array | None = None, keep_as_is: bool = False) -> jax.Array:
        fields = self._own_fields(keep_as_is)
        fields = fields if rows is None else {k: v[rows] for k, v in fields.items()}
        return BLOCK_FORMATS[Q(self.qtype)].dequantize(fields)

    def dense(self, x: jax.Array) -> jax.Array:
        """x [..., I] @ weight [O, I].T -> f32[..., O], in the model dtype as layers/linear.py's
        dense for a float weight.

        On CPU the native kernel (cpu_gguf.py) reads the packed bytes: it multiplies a few rows
        itself, and dequantizes the layer for XLA's matmul of more. Without it one row (a
        batch-1 decode step) multiplies and reduces, so that XLA fuses the dequantization into
        the product and reads only the packed bytes; more rows dequantize the weight once and
        run one matmul."""
        num_rows = math.prod(x.shape[:-1])
        xs = x.astype(self.dtype).astype(jnp.float32)
        if cpu_gguf.supports(self.dtype):
            stacked = self.layer is not None
            fields = self.fields if stacked else {k: v[None] for k, v in self.fields.items()}
            layer = self.layer if stacked else 0
            y = cpu_gguf.dense(xs.reshape(num_rows, -1), fields, layer, self.qtype, self.dtype)
            return y.reshape(*x.shape[:-1], -1)
        if num_rows == 1:
            # Reduced over the blocks' own [nb, block_size] axes, with x one flat row: a
            # broadcast [1, O, I] product ran 8x slower (BENCHMARKS.md, "Quantized weights").
            # A stacked weight's layer is copied out first: XLA:CPU would otherwise fuse the
            # slice into a slow fusion that writes it out as float32 (bfloat16 weights read
            # that way ran batch-1 decode at 3 against 36 tok/s).
            w = self._blocks(keep_as_is=True).astype(self.dtype).astype(jnp.float32)
            return (w * xs.reshape(w.shape[-2:])).sum((-1, -2)).reshape(*x.shape[:-1], -1)
        return dot_rows(x, self.dequantize().astype(self.dtype))  # [O, I]
