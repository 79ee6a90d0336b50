"""The gated MLP of the Llama-like families, and the plain one of GPT-2 and OPT."""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import ACTIVATIONS
from jvllm.layers.linear import Linear
from jvllm.layers.lora import lora_shape


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one projection [2F, D], biased where
    `bias` (Llama's mlp_bias).

    F is `intermediate_size` where given (Qwen2-MoE's shared expert), else the config's. Without
    `sum_shards`, a tensor-parallel layer returns its device's partial sum for the caller to
    add to its own before one all-reduce (the shared expert beside the experts, layers/moe.py).
    """

    def __init__(
        self,
        config: ModelConfig,
        intermediate_size: int | None = None,
        *,
        sum_shards: bool = True,
        bias: bool = False,
    ):
        d, dtype = config.hidden_size, jnp.dtype(config.dtype)
        f = intermediate_size or config.intermediate_size
        num_shards = config.num_shards if sum_shards else 1
        segments = ((f, 1), (f, 1))
        lora = lora_shape(config)
        self.gate_up = Linear(
            d,
            2 * f,
            ("mlp", "embed"),
            dtype=dtype,
            bias=bias,
            segments=segments,
            lora=lora_shape(config, num_pieces=2),
        )
        self.down = Linear(
            f, d, ("embed", "mlp"), dtype=dtype, bias=bias, num_shards=num_shards, lora=lora
        )
        self.act = config.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)  # [T, F] each
        return self.down(ACTIVATIONS[self.act](gate) * up)  # [T, D]


class MLP(nnx.Module):
    """down(act(up(x))) with up [F, D] and down [D, F], biased where `bias` (GPT-2, OPT)."""

    def __init__(self, config: ModelConfig, *, bias: bool):
        d, f, dtype = config.hidden_size, config.intermediate_size, jnp.dtype(config.dtype)
        lora = lora_shape(config)
        self.up = Linear(d, f, ("mlp", "embed"), dtype=dtype, bias=bias, lora=lora)
        self.down = Linear(
            f, d, ("embed", "mlp"), dtype=dtype, bias=bias, num_shards=config.num_shards, lora=lora
        )
        self.act = config.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(ACTIVATIONS[self.act](self.up(x)))  # [T, D]
