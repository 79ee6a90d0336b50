"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): routing, then the experts as a grouped matmul.

Glossary: T tokens, D hidden, F expert intermediate, E experts, k experts per token.

Expert weights keep HF's fused module layout, torch-like [out, in] as `dense` does:
    gate_up [E, 2F, D]  (gate then up; logical axes "experts", "mlp", "embed")
    down    [E, D, F]   (logical axes "experts", "embed", "mlp")
so HF's fused tensors load without a transpose; `ragged_dot_general` contracts their minor axis
D (resp. F). As for the dense gate|up, tensor parallelism over the fused 2F axis needs the gate
and up halves laid out shard by shard.
"""

import jax
import jax.numpy as jnp

from jvllm.layers.linear import dense

# The ragged dot's operands: lhs [M, I] rows sorted by group, rhs [E, O, I]; contract I.
_GROUPED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)


def route(
    x: jax.Array, router: jax.Array, top_k: int, renormalize: bool
) -> tuple[jax.Array, jax.Array]:
    """Pick top_k experts per token: x [T, D], router [E, D] -> (f32[T, k], i32[T, k]).

    As HF: softmax over all E router logits in float32, then the top_k probabilities, which are
    divided by their sum when `renormalize` (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
    The logits accumulate in float32 here (HF rounds them to the model dtype first), and the
    weights stay float32 (Qwen3-MoE rounds them to the model dtype, Mixtral does not).
    """
    probs = jax.nn.softmax(dense(x, router), axis=-1)  # f32[T, E]
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def moe_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) -> f32[T, D].

    x [T, D]; weights f32[T, k] and experts i32[T, k] from `route`; gate_up [E, 2F, D] and
    down [E, D, F] (see the module docstring). Each expert is down(silu(gate) * up).

    The T*k (token, expert) assignments are sorted by expert, so each expert's rows are
    contiguous, and both projections run as one grouped matmul (`jax.lax.ragged_dot_general`)
    with the per-expert row counts as group sizes. Inputs are cast to the weight dtype and the
    products accumulate in float32, as in `dense`.
    """
    num_tokens, top_k = experts.shape
    num_experts = gate_up.shape[0]
    flat_experts = experts.reshape(-1)  # [T*k]
    order = jnp.argsort(flat_experts, stable=True)  # [T*k] assignment ids, grouped by expert
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # [E]
    rows = x.astype(gate_up.dtype)[order // top_k]  # [T*k, D]

    gate, up = jnp.split(_grouped_dense(rows, gate_up, group_sizes), 2, axis=-1)  # [T*k, F] each
    hidden = jax.nn.silu(gate) * up  # f32[T*k, F]
    out = _grouped_dense(hidden.astype(down.dtype), down, group_sizes)  # f32[T*k, D]

    # Back to assignment order (the inverse permutation of `order`), then weight and sum.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    out = out[inverse].reshape(num_tokens, top_k, -1)  # [T, k, D]
    return jnp.einsum("tkd,tk->td", out, weights.astype(jnp.float32))


def dense_moe_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """moe_mlp computed by running every expert on every token -> f32[T, D].

    Same arguments and result as `moe_mlp`; the experts a token did not pick get weight 0.
    E/k times the grouped flops: the benchmark's baseline and a second reference for tests.
    """
    num_experts, two_f, d = gate_up.shape
    dense_weights = jnp.zeros((experts.shape[0], num_experts), jnp.float32)  # [T, E]
    dense_weights = jax.vmap(lambda w, e, p: w.at[e].set(p))(dense_weights, experts, weights)

    gate_up_out = dense(x, gate_up.reshape(num_experts * two_f, d))  # f32[T, E*2F]
    gate, up = jnp.split(gate_up_out.reshape(-1, num_experts, two_f), 2, axis=-1)  # [T, E, F]
    hidden = jax.nn.silu(gate) * up  # f32[T, E, F]
    contract = (((2,), (2,)), ((1,), (0,)))  # over F, batched over E
    out = jax.lax.dot_general(
        hidden.astype(down.dtype), down, contract, preferred_element_type=jnp.float32
    )  # [E, T, D]
    return jnp.einsum("etd,te->td", out, dense_weights)


def _grouped_dense(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, I] (grouped by expert, group_sizes i32[E]) @ w[e] [O, I].T per group -> f32[M, O]."""
    return jax.lax.ragged_dot_general(
        rows.astype(w.dtype),
        w,
        group_sizes,
        _GROUPED_DIMS,
        preferred_element_type=jnp.float32,
    )
