"""A weight kept quantized on the device, used where the model would use its float array.

`GGUFWeight` holds a [..., O, I] weight as GGUF blocks (quantization/gguf_blocks.py). It is a
pytree whose leaves are the blocks' fields, so it travels in the params pytree through jit, the
layer scan (which slices every field's leading [L] axis) and donation like any array. The
layers reach it through `dense` and the embedding's row lookup; both dequantize inside the
jitted step, so a step reads the packed bytes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from gguf.constants import GGMLQuantizationType as Q

from jvllm.layers.dot import dot_rows
from jvllm.quantization.gguf_blocks import BLOCK_FORMATS, Fields


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GGUFWeight:
    """fields: each block field as [..., O, nb, *field_shape]; qtype: the block format;
    dtype: the model dtype the values are used in (float32 keeps them exactly)."""

    fields: Fields
    qtype: int = dataclasses.field(metadata={"static": True})
    dtype: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [..., O, I]."""
        fmt = BLOCK_FORMATS[Q(self.qtype)]
        first = self.fields[fmt.fields.names[0]]
        lead = first.shape[: first.ndim - len(fmt.fields[0].shape)]  # [..., O, nb]
        return (*lead[:-1], lead[-1] * fmt.block_size)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields.values())

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

    def _blocks(self, rows: jax.Array | None = None) -> jax.Array:
        fields = self.fields if rows is None else {k: v[rows] for k, v in self.fields.items()}
        return BLOCK_FORMATS[Q(self.qtype)].dequantize(fields)

    def dense(self, x: jax.Array) -> jax.Array:
        """x [..., I] @ weight [O, I].T -> f32[..., O], in the model dtype as layers/linear.py's
        dense for a float weight. One row (a batch-1 decode step) multiplies and reduces, so
        that XLA fuses the dequantization into the product and reads only the packed bytes;
        more rows dequantize the weight once and run one matmul."""
        if math.prod(x.shape[:-1]) == 1:
            # Reduced over the blocks' own [nb, block_size] axes, with x one flat row: a
            # broadcast [1, O, I] product ran 8x slower (BENCHMARKS.md, "Quantized weights").
            w = self._blocks().astype(self.dtype).astype(jnp.float32)  # [O, nb, block_size]
            xs = x.astype(self.dtype).astype(jnp.float32).reshape(w.shape[-2:])
            return (w * xs).sum((-1, -2)).reshape(*x.shape[:-1], -1)
        return dot_rows(x, self.dequantize().astype(self.dtype))  # [O, I]
