"""gpt-oss's mixture of experts (HF's GptOssMLP): a router with a bias whose top-k logits are
softmaxed among themselves, and experts with biases and a clamped SwiGLU, run as grouped
matmuls like the other families' experts (layers/moe.py).

Glossary: T tokens, D hidden, F expert intermediate, E experts, k experts per token.

Weights in layers/moe.py's ragged_dot layout, gate then up along 2F:
    gate_up [E, D, 2F], gate_up_bias f32[E, 2F], down [E, F, D], down_bias f32[E, D].
HF's gate_up_proj interleaves the two along 2F (gate = [..., ::2], up = [..., 1::2]); the
loader splits it (`split_interleaved`) so that tensor parallelism cuts gate and up as it cuts
the other families' (params.py's segments).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.expert_counts import count_experts
from jvllm.layers.linear import dense
from jvllm.layers.moe import combine, group_by_expert, grouped_dense
from jvllm.layers.parallel import experts_over_ranks, first_local_expert, sum_over_shards
from jvllm.layers.params import param


def split_interleaved(w: np.ndarray) -> np.ndarray:
    """HF's [..., 2F] with gate and up interleaved -> [..., 2F] gate then up (for the loader)."""
    return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)


def route_top_logits(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """logits f32[T, E] (the router's, bias included) -> (weights f32[T, k], experts i32[T, k]).

    As HF's GptOssTopKRouter: the top_k logits, then a softmax over those k alone (which equals
    a softmax over all E renormalised over the top k)."""
    top_logits, experts = jax.lax.top_k(logits, top_k)  # [T, k] each
    return jax.nn.softmax(top_logits, axis=-1), experts.astype(jnp.int32)


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """HF's GptOssExperts._apply_gate: gate capped above at `limit`, up clipped to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def gpt_oss_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: jax.Array,
    gate_up_bias: jax.Array,
    down: jax.Array,
    alpha: float,
    limit: float,
    first_expert: jax.Array | None = None,
) -> jax.Array:
    """sum_k weights[t, k] * down_{e}(clamped_swiglu(gate_up_{e}(x[t]) + gate_up_bias[e])) for
    e = experts[t, k] -> f32[T, D], without the down bias (`GptOssMoE` adds it after the
    tensor-parallel sum, so that it is added once).

    As layers/moe.py's moe_mlp: the T*k (token, expert) rows sorted by expert, each projection
    one grouped matmul over the experts' row counts, then back to token order; first_expert
    as moe_mlp's (expert parallelism: the held experts' assignments alone).
    """
    num_experts = gate_up.shape[0]
    local, order, group_sizes, is_held = group_by_expert(experts, num_experts, first_expert)
    rows = x[order // experts.shape[1]]  # [T*k, D]

    # The rows of experts held elsewhere (local E) take the last expert's bias; combine drops them.
    bias = gate_up_bias[jnp.minimum(local[order], num_experts - 1)]  # f32[T*k, 2F]
    hidden = grouped_dense(rows, gate_up, group_sizes) + bias
    gate, up = jnp.split(hidden, 2, axis=-1)  # f32[T*k, F] each
    activated = clamped_swiglu(gate, up, alpha, limit).astype(down.dtype)
    out = grouped_dense(activated, down, group_sizes)  # f32[T*k, D]
    return combine(out, order, weights, is_held)


class GptOssMoE(nnx.Module):
    """The router ([E, D] and a bias [E]), `route_top_logits`, then `gpt_oss_experts`
    and each chosen expert's down bias, weighted. Under tensor parallelism every device holds a
    slice of each expert's F, under expert parallelism E/T whole experts (with their gate_up
    biases); its partial sums are summed over the devices before the biases of down (whole on
    every device, read by the router's ids) are added."""

    def __init__(self, config: ModelConfig):
        d, e, f = config.hidden_size, config.num_local_experts, config.moe_intermediate_size
        dtype = jnp.dtype(config.dtype)
        halves = ((f, 1), (f, 1))  # gate | up
        self.router = param((config.num_experts, d), dtype, ("experts", "embed"))
        self.router_bias = param((config.num_experts,), jnp.float32, ("experts",))
        self.gate_up = param((e, d, 2 * f), dtype, ("experts", "embed", "mlp"), halves)
        self.gate_up_bias = param((e, 2 * f), jnp.float32, ("experts", "mlp"), halves)
        self.down = param((e, f, d), dtype, ("experts", "mlp", "embed"))
        self.down_bias = param((config.num_experts, d), jnp.float32, ("experts", "embed"))
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.alpha = config.option("swiglu_alpha")
        self.limit = config.option("swiglu_limit")
        self.num_shards = config.num_shards
        self.num_local_experts, self.num_expert_shards = e, config.num_expert_shards
        self.num_data_ranks = config.num_data_ranks
        self.config = config  # how the data-parallel ranks exchange tokens: experts_over_ranks

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[T, D] -> f32[T, D]."""
        logits = dense(x, self.router[...]) + self.router_bias[...]  # f32[T, E]
        weights, experts = route_top_logits(logits, self.top_k)  # [T, k] each
        count_experts(experts, self.num_experts)
        first = first_local_expert(
            self.num_local_experts, self.num_expert_shards, self.num_data_ranks
        )
        run = lambda x, w, e: gpt_oss_experts(
            x,
            w,
            e,
            self.gate_up[...],
            self.gate_up_bias[...],
            self.down[...],
            self.alpha,
            self.limit,
            first,
        )
        out = experts_over_ranks(run, x, weights, experts, self.config)
        out = sum_over_shards(out, self.num_shards)  # [T, D]
        return out + jnp.einsum("tk,tkd->td", weights, self.down_bias[...][experts])
