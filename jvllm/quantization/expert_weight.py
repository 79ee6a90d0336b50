"""A MoE's routed experts in int8 or fp8 with one scale per (expert, output channel), made at
load (quantization="int8" | "fp8") as channel_weight.py's dense weights are.

An expert stack keeps layers/moe.py's ragged_dot layout [..., E, I, O] and holds values of
that shape and scale f32[..., E, O], with w[e, :, o] ~= values[e, :, o] * scale[e, o]: each
output channel's largest |w| over I mapped to the format's largest value, the rounding of
quantize_rows. The scale is per output channel, so it factors out of each expert's product: the
grouped matmul runs on the 1-byte values converted to the model dtype (exact for both formats)
and each row of its float32 result is scaled by its expert's channel scales.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jvllm.quantization.channel_weight import FORMATS, ScaledValues
from jvllm.quantization.rows import quantize_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeight(ScaledValues):
    """values: [..., E, I, O] int8 or float8_e4m3fn; scale: f32[..., E, O]; dtype: the model
    dtype the values are used in; layer: None, or i32[] when values and scale are stacked
    [L, ...] and the weight is layer `layer` of them (the layer scan's at_layer)."""

    values: jax.Array
    scale: jax.Array
    dtype: str = dataclasses.field(metadata={"static": True})
    layer: jax.Array | None = None

    def __getitem__(self, key):
        """`param[...]` (how the layers read a weight) gives the weight itself."""
        if key is not Ellipsis:
            raise TypeError("a quantized expert stack is read whole (weight[...])")
        return self

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """rows [M, I] grouped by expert (group_sizes i32[E]) @ expert e's [I, O] per group ->
        f32[M, O]: one ragged_dot over the values in the model dtype (this layer's E experts
        converted, never the whole stack), then each row times its expert's scales."""
        values, scale = self._own(self.values), self._own(self.scale)  # [E, I, O], [E, O]
        y = jax.lax.ragged_dot(
            rows.astype(self.dtype),
            values.astype(self.dtype),
            group_sizes,
            preferred_element_type=jnp.float32,
        )  # [M, O]
        num_experts, num_rows = values.shape[0], rows.shape[0]
        row_experts = jnp.repeat(
            jnp.arange(num_experts), group_sizes, total_repeat_length=num_rows
        )  # [M]
        return y * scale[row_experts]

    def _own(self, x: jax.Array) -> jax.Array:
        """This weight's own slice of a field (values or scale): a stacked one's layer."""
        return x if self.layer is None else jax.lax.dynamic_index_in_dim(x, self.layer, 0, False)


def quantize_experts(w: jax.Array, method: str, dtype: str) -> ExpertWeight:
    """A float expert stack [..., E, I, O] -> its ExpertWeight ("int8" or "fp8"), one [I, O]
    matrix at a time, as channel_weight.quantize_channels and for the same reason (the float32
    intermediates of a whole stack outgrow the device)."""
    values_dtype = FORMATS[method]
    if w.ndim < 3:
        return ExpertWeight(*_quantize_columns(w, values_dtype), dtype)
    parts = [quantize_experts(part, method, dtype) for part in w]
    values = jnp.stack([part.values for part in parts])  # [..., E, I, O]
    scale = jnp.stack([part.scale for part in parts])  # [..., E, O]
    return ExpertWeight(values, scale, dtype)


# A load-time function, jitted as channel_weight's _quantize_weight: the transposes and the
# float32 intermediates stay inside one fused computation.
@functools.partial(jax.jit, static_argnums=1)
def _quantize_columns(w: jax.Array, values_dtype) -> tuple[jax.Array, jax.Array]:
    """w [I, O] -> (values [I, O], scale f32[O]): quantize_rows over each output column."""
    values, scale = quantize_rows(w.T, values_dtype, jnp.float32)  # [O, I], [O]
    return values.T, scale
