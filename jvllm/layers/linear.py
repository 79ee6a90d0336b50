"""Dense projection with float32 accumulation, and the Linear module built on it."""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.layers.lora import lora_delta
from jvllm.layers.parallel import sum_over_shards
from jvllm.layers.params import Segments, param
from jvllm.layers.scan import LayerWeight
from jvllm.quantization import QuantizedWeight, is_quantized
from jvllm.quantization.dot import dot_rows


def dense(x: jax.Array, w: jax.Array | LayerWeight | QuantizedWeight) -> jax.Array:
    """x [..., I] @ w [O, I].T -> float32 [..., O]; a quantized w dequantizes in the step
    (jvllm/quantization/), a scanned layer's is read where it lies (layers/scan.py).

    Weights keep the torch layout [out, in]: contracting the minor axis of both operands ran
    the SmolLM2 bfloat16 decode step 7% faster on this CPU than an [in, out] copy (bench in
    BENCHMARKS.md). The input is cast to the weight dtype and the product accumulates in
    float32: bfloat16 x bfloat16 -> float32 runs about 4x faster than float32, while asking XLA
    for a bfloat16 *result* is about 5x slower, so the output is always float32.
    """
    if is_quantized(w) or isinstance(w, LayerWeight):
        return w.dense(x)
    return dot_rows(x, w)


class Linear(nnx.Module):
    """x [..., I] -> float32 [..., O]: `dense` with weight [O, I] in the model dtype (the torch
    layout, so checkpoints load without a transpose) and an optional float32 bias [O].

    `segments` describes a fused output axis (params.py). With `num_shards` > 1 the layer is
    row-parallel: each device holds a slice of I, and the partial products are summed over the
    devices before the bias is added. `lora` (S slots, W' columns a slot; layers/lora.py's
    lora_shape) gives it adapter slots A [S*W', I] and B [O, S*W'], added to its output for
    the tokens that read them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axes: tuple[str, str],
        *,
        dtype,
        bias: bool = False,
        segments: Segments | None = None,
        num_shards: int = 1,
        lora: tuple[int, int] | None = None,
    ):
        self.weight = param((out_features, in_features), dtype, axes, segments)
        self.bias = param((out_features,), jnp.float32, axes[:1], segments) if bias else None
        self.num_shards = num_shards
        self.lora_slots = lora[0] if lora else 0
        if lora:
            width = lora[0] * lora[1]
            self.lora_a = param((width, in_features), dtype, ("lora", axes[1]))
            self.lora_b = param((out_features, width), dtype, (axes[0], "lora"), segments)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = dense(x, self.weight.get_value())
        if self.lora_slots:
            # Row-parallel, A is cut on I like the weight: each device's term is a partial
            # sum too (the slot mask and B act on the rank axis), summed with the weight's.
            a, b = self.lora_a.get_value(), self.lora_b.get_value()
            delta = lora_delta(x, a, b, self.lora_slots, dense)
            y = y if delta is None else y + delta
        y = sum_over_shards(y, self.num_shards)
        return y if self.bias is None else y + self.bias[...]
