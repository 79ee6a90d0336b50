"""int8 and fp8 weights with one scale per output channel, quantized at load (vLLM's online
`quantization="fp8"`, and its int8 counterpart).

A [..., O, I] weight becomes values [..., O, I] (int8, or float8 e4m3) and scale f32[..., O]
with w ~= values * scale: symmetric, the largest |w| of a row mapped to the format's largest
value. Because the scale is per output row, it factors out of the matmul: the step multiplies
by the 1-byte values (converted in the model dtype, exact for both formats) and scales the
float32 result, so a decode step reads one byte per weight. On a GPU, fp8 weights meet
activations quantized to fp8 per row in an fp8 matmul.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jvllm.quantization import cpu_int8, cpu_int_group
from jvllm.quantization.dot import dot_rows
from jvllm.quantization.rows import quantize_rows

FORMATS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}  # method -> the values' dtype


class ScaledValues:
    """What a weight of 1-byte `values` and float32 `scale`, stacked [L, ...] or not (`layer`),
    answers as a param: its own layer, shape and bytes (ChannelWeight's and ExpertWeight's)."""

    def at_layer(self, layer: jax.Array):
        """Layer i32[] of a stacked weight, without slicing its values."""
        return dataclasses.replace(self, layer=layer)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape if self.layer is None else self.values.shape[1:]

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChannelWeight(ScaledValues):
    """values: [..., O, I] int8 or float8_e4m3fn; scale: f32[..., O]; dtype: the model dtype
    the values are used in; layer: None, or i32[] when values and scale are stacked [L, ...]
    and the weight is layer `layer` of them."""

    values: jax.Array
    scale: jax.Array
    dtype: str = dataclasses.field(metadata={"static": True})
    layer: jax.Array | None = None

    def __getitem__(self, key):
        """`param[...]` (how the layers read a weight) gives the weight itself."""
        if key is not Ellipsis:
            raise TypeError("a quantized weight is read whole (weight[...]); use dense()")
        return self

    def dense(self, x: jax.Array) -> jax.Array:
        """x [..., I] @ weight [O, I].T -> f32[..., O]: the values converted to the model dtype
        (exact: 1-byte values fit every model dtype) meet x in a matmul, and the result is
        scaled. On CPU int8 values in a bfloat16 model go through cpu_int8.py, whose kernel reads
        a stacked layer in place and applies the scale itself, and fp8 values through the
        grouped kernel (cpu_int_group.py), which makes them where they lie (a scale of one: the
        values themselves) for the result to be scaled; otherwise dot.py's matmul."""
        if cpu_int8.supports(self.values, self.dtype):
            stacked = self.layer is not None
            values = self.values if stacked else self.values[None]  # [L, O, I]
            scale = self.scale if stacked else self.scale[None]  # [L, O]
            rows = x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16)  # [R, I]
            y = cpu_int8.dense(rows, values, scale, self.layer if stacked else 0)
            return y.reshape(*x.shape[:-1], -1)
        num_out, num_in = self.values.shape[-2:]
        fp8 = self.values.dtype == jnp.float8_e4m3fn
        if fp8 and num_in % 32 == 0 and cpu_int_group.supports(self.dtype, 8, num_in, jnp.float32):
            stacked = self.layer is not None
            values = self.values if stacked else self.values[None]  # [L, O, I]
            ones = jnp.ones((values.shape[0], 1, 1), jnp.float32)  # one scale a layer
            rows = x.reshape(-1, num_in)
            layer = self.layer if stacked else 0
            y = cpu_int_group.dense(rows, values, ones, None, layer, 8, num_in, self.dtype, num_out)
            return y.reshape(*x.shape[:-1], -1) * self._own(self.scale)
        values, scale = self._own(self.values), self._own(self.scale)  # [O, I], [O]
        if fp8 and jax.default_backend() == "gpu":
            return fp8_matmul(x, values, scale)
        return dot_rows(x, values.astype(self.dtype)) * scale

    def _own(self, x: jax.Array) -> jax.Array:
        """This weight's own slice of a field (values or scale): a stacked one's layer."""
        return x if self.layer is None else jax.lax.dynamic_index_in_dim(x, self.layer, 0, False)

    def dequantize(self) -> jax.Array:
        """-> [O, I] in the model dtype."""
        values, scale = self._own(self.values), self._own(self.scale)
        return (values.astype(jnp.float32) * scale[..., None]).astype(self.dtype)


def fp8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., I] @ fp8 values [O, I].T with scale f32[O] -> f32[..., O] in fp8: each row of x
    is scaled to e4m3's range and rounded to it, the product accumulates in float32, and both
    scales are applied to the result (dynamic per-token activation scales, as vLLM's fp8
    linear)."""
    xq, x_scale = quantize_rows(x, jnp.float8_e4m3fn, jnp.float32)  # [..., I], [...]
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(xq, values, contract, preferred_element_type=jnp.float32)
    return y * x_scale[..., None] * scale


def quantize_channels(w: jax.Array, method: str, dtype: str) -> ChannelWeight:
    """A float weight [..., O, I] -> its ChannelWeight ("int8" or "fp8"), one [O, I] matrix at
    a time: the float32 intermediates then take twice one matrix's bytes, where over a whole
    stacked weight they took several times the stack's (BENCHMARKS.md, "Quantizing at load")."""
    values_dtype = FORMATS[method]
    if w.ndim < 3:
        return ChannelWeight(*_quantize_weight(w, values_dtype), dtype)
    layers = [quantize_channels(layer, method, dtype) for layer in w]
    values = jnp.stack([layer.values for layer in layers])  # [L, O, I]
    scale = jnp.stack([layer.scale for layer in layers])  # [L, O]
    return ChannelWeight(values, scale, dtype)


# A load-time function, not a step's; jitted, so that one float32 copy of the matrix is left of
# its intermediates (op by op, three were alive at once).
@functools.partial(jax.jit, static_argnums=1)
def _quantize_weight(w: jax.Array, values_dtype) -> tuple[jax.Array, jax.Array]:
    return quantize_rows(w, values_dtype, jnp.float32)  # [O, I], [O]
