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
laid out shard by shard. Under expert parallelism a device holds E/T whole experts instead, and
runs only their (token, expert) assignments (`group_by_expert`).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import ACTIVATIONS
from jvllm.layers.expert_counts import count_experts
from jvllm.layers.linear import dense
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.parallel import experts_over_ranks, first_local_expert, sum_over_shards
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


def group_by_expert(
    experts: jax.Array, num_experts: int, first_expert: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The T*k (token, expert) assignments grouped by expert, for grouped matmuls over the
    E experts a layer holds (the router's ids first_expert .. first_expert + E - 1).

    experts i32[T, k] (the router's ids) -> (local i32[T*k]: each assignment's expert among the
    held ones, E where it is not held; order i32[T*k]: the assignments sorted by `local`;
    group_sizes i32[E]: each held expert's assignments; is_held bool[T, k], or None where
    first_expert is None and every expert is held).

    An assignment to an expert the device does not hold (expert parallelism) sorts after
    every group and into none: ragged_dot gives its rows 0 and a grouped kernel no work, so a
    device runs its share of the assignments. Mapping them to a held expert with weight 0
    would have run all T*k through the device's experts, T times the work."""
    local = experts.reshape(-1)  # [T*k]
    is_held = None
    if first_expert is not None:
        local = local - first_expert
        is_held = (local >= 0) & (local < num_experts)
        local = jnp.where(is_held, local, num_experts)
        is_held = is_held.reshape(experts.shape)
    order = jnp.argsort(local, stable=True)  # [T*k] assignment ids, grouped by expert
    # bincount drops the ids past `length`: the assignments of experts held elsewhere.
    group_sizes = jnp.bincount(local, length=num_experts).astype(jnp.int32)  # [E]
    return local, order, group_sizes, is_held


def combine(
    out: jax.Array, order: jax.Array, weights: jax.Array, is_held: jax.Array | None
) -> jax.Array:
    """The grouped rows out f32[T*k, D] (in `order`, `group_by_expert`'s) back in assignment
    order, weighted by weights f32[T, k] and summed per token -> f32[T, D]; the assignments
    not `is_held` count 0."""
    num_tokens, top_k = weights.shape
    # The inverse permutation of `order`.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    out = out[inverse].reshape(num_tokens, top_k, -1)  # [T, k, D]
    if is_held is not None:
        out = jnp.where(is_held[..., None], out, 0.0)
    return jnp.einsum("tkd,tk->td", out, weights.astype(jnp.float32))


def moe_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    first_expert: jax.Array | None = None,
    act: str = "silu",
) -> jax.Array:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) -> f32[T, D].

    x [T, D]; weights f32[T, k] and experts i32[T, k] from `route`; gate_up [E, D, 2F] and
    down [E, F, D] (see the module docstring). Each expert is down(act(gate) * up), `act` the
    config's hidden_act (layers/activation.py).
    first_expert: under expert parallelism, the router's id of gate_up's first expert
    (layers/parallel.py's first_local_expert); the sum then runs over the held experts alone.

    The T*k (token, expert) assignments are sorted by expert, so each expert's rows are
    contiguous, and both projections run as one grouped matmul (`jax.lax.ragged_dot`)
    with the per-expert row counts as group sizes. Inputs are cast to the weight dtype and the
    products accumulate in float32, as in `dense`.

    XLA:CPU has no grouped kernel: jax lowers ragged_dot there to one dot over all E experts with
    each expert's rows masked, k times dense_moe_mlp's work, so on CPU this is the slower of the
    two from a few tokens up (BENCHMARKS.md). On GPU and TPU, jax keeps ragged_dot as its own
    XLA instruction for the compiler's grouped matmul (not measured here yet).
    """
    _, order, group_sizes, is_held = group_by_expert(experts, gate_up.shape[0], first_expert)
    rows = x.astype(gate_up.dtype)[order // experts.shape[1]]  # [T*k, D]

    gate, up = jnp.split(grouped_dense(rows, gate_up, group_sizes), 2, axis=-1)  # [T*k, F] each
    hidden = ACTIVATIONS[act](gate) * up  # f32[T*k, F]
    out = grouped_dense(hidden.astype(down.dtype), down, group_sizes)  # f32[T*k, D]
    return combine(out, order, weights, is_held)


def dense_moe_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    act: str = "silu",
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
    hidden = (ACTIVATIONS[act](gate) * up).astype(down.dtype)  # [T, E, F]
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
    the module docstring); under expert parallelism a device's layer holds its E/T experts
    whole (the router all E), under tensor parallelism a slice of every expert's F.

    With `shared_expert_intermediate_size` (Qwen2-MoE), every token also runs a shared expert, a
    gated MLP of that width, scaled by sigmoid(shared_gate . x) (shared_gate [D]: HF's [1, D]
    shared_expert_gate) and added to the experts' sum, as HF's Qwen2MoeSparseMoeBlock does."""

    def __init__(self, config: ModelConfig):
        d, e = config.hidden_size, config.num_local_experts
        f = config.moe_intermediate_size or config.intermediate_size
        dtype = jnp.dtype(config.dtype)
        self.router = param((config.num_experts, d), dtype, ("experts", "embed"))
        self.gate_up = param((e, d, 2 * f), dtype, ("experts", "embed", "mlp"), ((f, 1), (f, 1)))
        self.down = param((e, f, d), dtype, ("experts", "mlp", "embed"))
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.act = config.hidden_act
        self.num_experts = config.num_experts
        self.num_shards = config.num_shards
        self.num_local_experts, self.num_expert_shards = e, config.num_expert_shards
        self.num_data_ranks = config.num_data_ranks
        self.config = config  # how the data-parallel ranks exchange tokens: experts_over_ranks
        shared_f = config.shared_expert_intermediate_size
        # Its partial sum joins the experts' before their one all-reduce.
        self.shared_expert = GatedMLP(config, shared_f, sum_shards=False) if shared_f else None
        self.shared_gate = param((d,), dtype, ("embed",)) if shared_f else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[T, D] -> f32[T, D]."""
        weights, experts = route(x, self.router[...], self.top_k, self.renormalize)
        count_experts(experts, self.num_experts)
        out = self.routed_experts(x, weights, experts)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(dense(x, self.shared_gate[...][None]))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return sum_over_shards(out, self.num_shards)

    def routed_experts(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """This device's experts' partial sums f32[T, D] for the routes `route` gave x, its
        rank's tokens (across data-parallel ranks, run on every rank's: experts_over_ranks)."""
        first = first_local_expert(
            self.num_local_experts, self.num_expert_shards, self.num_data_ranks
        )
        run = lambda x, w, e: moe_mlp(
            x, w, e, self.gate_up[...], self.down[...], first, act=self.act
        )
        return experts_over_ranks(run, x, weights, experts, self.config)
