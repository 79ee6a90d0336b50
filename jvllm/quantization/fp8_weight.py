"""FP8 (e4m3) weights as pre-quantized checkpoints ship them, kept in fp8 on the device: one scale
per block of (rows, columns) of the weight (DeepSeek-V3's and Qwen3-*-FP8's 128 x 128), per
output channel (a block of one row) or per tensor (a block of the whole weight).

A [..., O, I] weight holds values float8_e4m3fn[..., O, I] and scale [..., ceil(O / bo),
ceil(I / bi)] in the checkpoint's scale dtype; w = values * scale[o // bo, i // bi], computed
rounded to the scale dtype and converted to the model dtype, as compressed_tensors' decompression and
transformers' FP8 dequantization compute it (`dequantize`). Activations stay unquantized (jvllm
logs that at load) but on a GPU where the scheme quantizes them. On CPU the grouped kernel
(cpu_int_group.py) makes those values where a layer's fp8 bytes lie and multiplies them in, a
byte a weight read (XLA's dequantize-then-matmul converted the layer each step: the default
model's batch-1 decode 0.38x bfloat16's); elsewhere the step dequantizes the layer for one
matmul.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jvllm.quantization import cpu_int_group
from jvllm.quantization.channel_weight import fp8_matmul
from jvllm.quantization.dot import dot_rows
from jvllm.quantization.int_weight import pallas_dequant, rounded
from kernels_pallas import fp8_block_matmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weight:
    """values: float8_e4m3fn[..., O, I]; scale: [..., O / bo, I / bi] (rounded up); block:
    (bo, bi); dtype: the model dtype; experts: the weight is a MoE's expert stack [..., E, O, I]
    that layers/moe.py reads as [..., E, I, O] (`grouped`); dynamic_activations: the scheme
    quantizes activations to fp8 per token, which a GPU then does where a scale covers whole
    rows (`dense`); layer: None, or i32[] when the fields are stacked [L, ...] and the weight is
    layer `layer` of them."""

    values: jax.Array
    scale: jax.Array
    block: tuple[int, int] = dataclasses.field(metadata={"static": True})
    dtype: str = dataclasses.field(metadata={"static": True})
    experts: bool = dataclasses.field(default=False, metadata={"static": True})
    dynamic_activations: bool = dataclasses.field(default=False, metadata={"static": True})
    layer: jax.Array | None = None

    def at_layer(self, layer: jax.Array) -> FP8Weight:
        return dataclasses.replace(self, layer=layer)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float param's shape: [..., O, I], an expert stack's [..., E, I, O]."""
        shape = self.values.shape if self.layer is None else self.values.shape[1:]
        return (*shape[:-2], shape[-1], shape[-2]) if self.experts else shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    def __getitem__(self, key):
        """`param[...]` (how the layers read a weight) gives the weight itself."""
        if key is not Ellipsis:
            raise TypeError("a quantized weight is read whole (weight[...]); use dense()")
        return self

    def _own(self, x: jax.Array) -> jax.Array:
        return x if self.layer is None else jax.lax.dynamic_index_in_dim(x, self.layer, 0, False)

    def dequantize(self) -> jax.Array:
        """-> [..., O, I] in the model dtype."""
        return dequantize_blocks(self._own(self.values), self._own(self.scale), self.block).astype(
            self.dtype
        )

    def dense(self, x: jax.Array) -> jax.Array:
        """x [..., I] @ weight [O, I].T -> f32[..., O]: on a GPU, activations quantized to fp8
        per token where the scheme says so and a scale covers whole rows (an fp8 matmul), else
        kernels_pallas' dequantizing matmul (each fp8 byte read once, a stacked layer where it
        lies); on CPU the native grouped kernel, which also reads a stacked layer where it lies,
        its values `dequantize`'s; elsewhere the layer dequantized in the step and one
        matmul."""
        num_in = self.values.shape[-1]
        if jax.default_backend() == "gpu" and self.dynamic_activations and self.block[1] >= num_in:
            # A scale a row (or block of rows): it factors out of the fp8 product, as vLLM's
            # FP8 W8A8 linear computes it.
            values, scale = self._own(self.values), self._own(self.scale)  # [O, I], [O / bo, 1]
            rows = jnp.repeat(scale[:, 0], self.block[0])[: values.shape[0]]  # [O]
            return fp8_matmul(x, values, rows.astype(jnp.float32))
        if pallas_dequant() and (self.block[1] >= num_in or self.block[1] % 16 == 0):
            rows = x.reshape(-1, num_in).astype(self.dtype)
            y = fp8_block_matmul.fp8_block_matmul(
                rows, self.values, self.scale, block=self.block, layer=self.layer
            )
            return y.reshape(*x.shape[:-1], -1)
        blocks = self._cpu_blocks()
        if blocks is not None:
            stacked = self.layer is not None
            values = self.values if stacked else self.values[None]  # [L, O, I]
            scale = self.scale if stacked else self.scale[None]  # [L, O / bo, I / bi]
            rows = x.reshape(-1, num_in)
            layer = self.layer if stacked else 0
            bo, bi = blocks
            y = cpu_int_group.dense(rows, values, scale, None, layer, 8, bi, self.dtype, bo)
            return y.reshape(*x.shape[:-1], -1)
        return dot_rows(x, self.dequantize())

    def _cpu_blocks(self) -> tuple[int, int] | None:
        """The (rows, columns) a scale covers here where the CPU kernel can take this weight
        (columns a multiple of 32, as I is; a device's own shapes under tensor parallelism),
        else None."""
        num_out, num_in = self.values.shape[-2:]
        block = (min(self.block[0], num_out), min(self.block[1], num_in))
        scales = (-(-num_out // block[0]), -(-num_in // block[1]))
        fits = self.scale.shape[-2:] == scales and num_in % 32 == 0
        if fits and cpu_int_group.supports(self.dtype, 8, block[1], self.scale.dtype):
            return block
        return None

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """rows [M, I] grouped by expert (group_sizes i32[E]) @ expert e's [I, O] -> f32[M, O]:
        this layer's experts dequantized in the step, then one ragged_dot."""
        w = jnp.swapaxes(self.dequantize(), -1, -2)  # [E, I, O]
        return jax.lax.ragged_dot(
            rows.astype(self.dtype), w, group_sizes, preferred_element_type=jnp.float32
        )


def dequantize_blocks(values: jax.Array, scale: jax.Array, block: tuple[int, int]) -> jax.Array:
    """values [..., O, I] * scale [..., ceil(O/bo), ceil(I/bi)] broadcast over its blocks ->
    [..., O, I] in scale's dtype."""
    num_out, num_in = values.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2)[..., :num_out, :], block[1], axis=-1)
    w = values.astype(jnp.float32) * s[..., :num_in].astype(jnp.float32)  # exact
    return rounded(w, scale.dtype)
