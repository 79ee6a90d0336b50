"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE): routing, then the experts as a
grouped matmul, plus Qwen2-MoE's gated shared expert.

Glossary: T tokens, D hidden, F expert intermediate, E experts, k experts per token.

Expert weights are stacked per expert in the [in, out] layout of `jax.lax.ragged_dot`'s rhs:
    gate_up [E, D, 2F]  (gate then up along 2F; logical axes "experts", "embed", "mlp")
    down    [E, F, D]   (logical axes "experts", "mlp", "embed")
unlike `dense`'s torch [out, in]. HF checkpoints store each expert's projections as separate
[out, in] tensors, so the loader stacks them anyway and transposes them then, once. On XLA:CPU
moe_mlp ran 1.1-1.6x faster with this layout than with [E, 2F, D] (BENCHMARKS.md).
As for the dense gate|up, tensor parallelism over the fused 2F axis needs the gate and up halves
laid out shard by shard.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.linear import dense
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.parallel import sum_over_shards
from jvllm.layers.params import param
from jvllm.quantization import ExpertWeight, is_quantized


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

    x [T, D]; weights f32[T, k] and experts i32[T, k] from `route`; gate_up [E, D, 2F] and
    down [E, F, D] (see the module docstring). Each expert is down(silu(gate) * up).

    The T*k (token, expert) assignments are sorted by expert, so each expert's rows are
    contiguous, and both projections run as one grouped matmul (`jax.lax.ragged_dot`)
    with the per-expert row counts as group sizes. Inputs are cast to the weight dtype and the
    products accumulate in float32, as in `dense`.

    XLA:CPU has no grouped kernel: jax lowers ragged_dot there to one dot over all E experts with
    each expert's rows masked, k times dense_moe_mlp's work, so on CPU this is the slower of the
    two from a few tokens up (BENCHMARKS.md). On GPU and TPU, jax keeps ragged_dot as its own
    XLA instruction for the compiler's grouped matmul (not measured here yet).
    """
    num_tokens, top_k = experts.shape
    num_experts = gate_up.shape[0]
    flat_experts = experts.reshape(-1)  # [T*k]
    order = jnp.argsort(flat_experts, stable=True)  # [T*k] assignment ids, grouped by expert
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # [E]
    rows = x.astype(gate_up.dtype)[order // top_k]  # [T*k, D]

    gate, up = jnp.split(grouped_dense(rows, gate_up, group_sizes), 2, axis=-1)  # [T*k, F] each
    hidden = jax.nn.silu(gate) * up  # f32[T*k, F]
    out = grouped_dense(hidden.astype(down.dtype), down, group_sizes)  # f32[T*k, D]

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
    num_experts = gate_up.shape[0]
    dense_weights = (jax.nn.one_hot(experts, num_experts) * weights[..., None]).sum(1)  # [T, E]

    x = x.astype(gate_up.dtype)
    gate_up_out = jnp.einsum("td,edo->teo", x, gate_up, preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up_out, 2, axis=-1)  # [T, E, F] each
    hidden = (jax.nn.silu(gate) * up).astype(down.dtype)  # [T, E, F]
    out = jnp.einsum("tef,efd->etd", hidden, down, preferred_element_type=jnp.float32)
    return jnp.einsum("etd,te->td", out, dense_weights)


def grouped_dense(
    rows: jax.Array, w: jax.Array | ExpertWeight, group_sizes: jax.Array
) -> jax.Array:
    """rows [M, I] (grouped by expert, group_sizes i32[E]) @ w[e] [I, O] per group -> f32[M, O];
    int8 / fp8 experts (quantization/expert_weight.py) scale their product in the step."""
    if is_quantized(w):
        return w.grouped(rows, group_sizes)
    return jax.lax.ragged_dot(
        rows.astype(w.dtype), w, group_sizes, preferred_element_type=jnp.float32
    )


class SparseMoE(nnx.Module):
    """The MoE MLP of Mixtral, Qwen3-MoE and Qwen2-MoE: a router [E, D], then each token's top-k
    experts (`route`) as grouped matmuls (`moe_mlp`). Expert weights in ragged_dot's layout (see
    the module docstring), the experts axis named for expert parallelism.

    With `shared_expert_intermediate_size` (Qwen2-MoE), every token also runs a shared expert, a
    gated MLP of that width, scaled by sigmoid(shared_gate . x) (shared_gate [D]: HF's [1, D]
    shared_expert_gate) and added to the experts' sum, as HF's Qwen2MoeSparseMoeBlock does."""

    def __init__(self, config: ModelConfig):
        d, e = config.hidden_size, config.num_experts
        f = config.moe_intermediate_size or config.intermediate_size
        dtype = jnp.dtype(config.dtype)
        self.router = param((e, d), dtype, ("experts", "embed"))
        self.gate_up = param((e, d, 2 * f), dtype, ("experts", "embed", "mlp"), ((f, 1), (f, 1)))
        self.down = param((e, f, d), dtype, ("experts", "mlp", "embed"))
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.num_shards = config.num_shards  # > 1: each device holds a slice of every expert's F
        shared_f = config.shared_expert_intermediate_size
        # Its partial sum joins the experts' before their one all-reduce.
        self.shared_expert = GatedMLP(config, shared_f, sum_shards=False) if shared_f else None
        self.shared_gate = param((d,), dtype, ("embed",)) if shared_f else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[T, D] -> f32[T, D]."""
        weights, experts = route(x, self.router[...], self.top_k, self.renormalize)
        out = moe_mlp(x, weights, experts, self.gate_up[...], self.down[...])  # [T, D]
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(dense(x, self.shared_gate[...][None]))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return sum_over_shards(out, self.num_shards)
