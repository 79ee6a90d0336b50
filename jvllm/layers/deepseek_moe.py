"""DeepSeek-V2 / V3's mixture of experts: its routers (softmax greedy, softmax group-limited,
sigmoid with a correction bias over groups; and ERNIE 4.5's softmax with a correction bias)
and the block that runs the chosen experts beside the always-on shared experts (GLM-4.5's and
ERNIE 4.5's MoE layers too).

Glossary as layers/moe.py: T tokens, D hidden, E experts, k experts per token, G groups.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.expert_counts import count_experts
from jvllm.layers.linear import dense
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.moe import moe_mlp
from jvllm.layers.parallel import experts_over_ranks, first_local_expert, sum_over_shards
from jvllm.layers.params import param

# HF's `topk_method`s: V2's two softmax routers, and V3's sigmoid one (which HF's V3 model
# always runs, whatever topk_method says); then ERNIE 4.5's.
ROUTINGS = ("greedy", "group_limited_greedy", "noaux_tc", "softmax_biased")
# The routers that choose by scores plus a correction bias [E].
BIASED_ROUTINGS = ("noaux_tc", "softmax_biased")
# Ernie4_5_MoeConfig's moe_norm_min: the least sum its top-k weights are divided by.
ERNIE_NORM_MIN = 1e-12


def _group_mask(group_scores: jax.Array, topk_group: int, num_experts: int) -> jax.Array:
    """group_scores f32[T, G] -> bool[T, E]: whether each expert is in one of the token's
    topk_group best groups (groups are E/G consecutive experts)."""
    num_groups = group_scores.shape[-1]
    _, best = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
    is_kept = jax.nn.one_hot(best, num_groups, dtype=jnp.bool_).any(axis=1)  # [T, G]
    return jnp.repeat(is_kept, num_experts // num_groups, axis=-1)  # [T, E]


def _grouped(scores: jax.Array, num_groups: int) -> jax.Array:
    """f32[T, E] -> f32[T, G, E/G]."""
    return scores.reshape(scores.shape[0], num_groups, -1)


def deepseek_route(
    logits: jax.Array,
    correction_bias: jax.Array | None,
    *,
    routing: str,
    top_k: int,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """Router logits f32[T, E] -> (weights f32[T, k], experts i32[T, k]), as HF's routers:

    - "greedy" (V2): the top k of softmax(logits);
    - "group_limited_greedy" (V2): softmax; each group scores its best expert; the experts
      outside the topk_group best groups score 0; then the top k;
    - "noaux_tc" (V3): scores sigmoid(logits); the experts are chosen by scores +
      `correction_bias`: each group scores the sum of its two best, the experts outside the
      topk_group best groups are dropped, then the top k; their weights are their unbiased
      scores, divided by their sum (+ 1e-20) where `renormalize`;
    - "softmax_biased" (ERNIE 4.5): softmax; the experts are chosen by scores +
      `correction_bias` (the top k); their weights are their unbiased scores divided by their
      sum (at least 1e-12), always.
    Every router then scales the weights by `scaling_factor` (routed_scaling_factor); HF's V2
    routers never renormalise."""
    num_experts = logits.shape[-1]
    if routing == "noaux_tc":
        scores = jax.nn.sigmoid(logits)  # [T, E]
        choice = scores + correction_bias
        top2, _ = jax.lax.top_k(_grouped(choice, num_groups), 2)  # [T, G, 2]
        mask = _group_mask(top2.sum(-1), topk_group, num_experts)
        _, experts = jax.lax.top_k(jnp.where(mask, choice, -jnp.inf), top_k)  # [T, k]
        weights = jnp.take_along_axis(scores, experts, axis=-1)  # [T, k]
        if renormalize:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    elif routing == "softmax_biased":
        scores = jax.nn.softmax(logits, axis=-1)  # [T, E]
        _, experts = jax.lax.top_k(scores + correction_bias, top_k)  # [T, k]
        weights = jnp.take_along_axis(scores, experts, axis=-1)  # [T, k]
        weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), ERNIE_NORM_MIN)
    else:
        scores = jax.nn.softmax(logits, axis=-1)  # [T, E]
        if routing == "group_limited_greedy":
            mask = _group_mask(_grouped(scores, num_groups).max(-1), topk_group, num_experts)
            scores = jnp.where(mask, scores, 0.0)
        weights, experts = jax.lax.top_k(scores, top_k)  # [T, k] each
    return weights * scaling_factor, experts.astype(jnp.int32)


class DeepseekMoE(nnx.Module):
    """The routed experts (layers/moe.py's grouped matmuls, in its weight layout) plus
    `n_shared_experts` shared experts, which HF runs as one gated MLP of n_shared * F (here
    config.shared_expert_intermediate_size) on every token. The router [E, D] and V3's
    correction bias [E] stay float32 whatever the model dtype, as HF keeps them, and whole on
    every device. Under tensor parallelism a device holds a slice of every expert's F and of
    the shared experts', under expert parallelism E/T whole routed experts and a slice of the
    shared experts': either way the two partial sums join before the layer's one all-reduce."""

    def __init__(self, config: ModelConfig):
        d, e, f = config.hidden_size, config.num_local_experts, config.moe_intermediate_size
        dtype, num_experts = jnp.dtype(config.dtype), config.num_experts
        self.router = param((num_experts, d), jnp.float32, ("experts", "embed"))
        self.routing = config.option("routing")
        is_biased = self.routing in BIASED_ROUTINGS
        self.correction_bias = (
            param((num_experts,), jnp.float32, ("experts",)) if is_biased else None
        )
        self.gate_up = param((e, d, 2 * f), dtype, ("experts", "embed", "mlp"), ((f, 1), (f, 1)))
        self.down = param((e, f, d), dtype, ("experts", "mlp", "embed"))
        shared_f = config.shared_expert_intermediate_size
        self.shared_experts = GatedMLP(config, shared_f, sum_shards=False) if shared_f else None
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.num_groups = config.option("n_group", 1)
        self.topk_group = config.option("topk_group", 1)
        self.renormalize = config.norm_topk_prob
        self.act = config.hidden_act
        self.scaling_factor = config.option("routed_scaling_factor", 1.0)
        self.num_shards = config.num_shards
        self.num_local_experts, self.num_expert_shards = e, config.num_expert_shards
        self.num_data_ranks = config.num_data_ranks
        self.config = config  # how the data-parallel ranks exchange tokens: experts_over_ranks

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[T, D] -> f32[T, D]."""
        logits = dense(x.astype(jnp.float32), self.router[...])  # f32[T, E]
        bias = None if self.correction_bias is None else self.correction_bias[...]
        weights, experts = deepseek_route(
            logits,
            bias,
            routing=self.routing,
            top_k=self.top_k,
            num_groups=self.num_groups,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            scaling_factor=self.scaling_factor,
        )
        count_experts(experts, self.num_experts)
        first = first_local_expert(
            self.num_local_experts, self.num_expert_shards, self.num_data_ranks
        )
        run = lambda x, w, e: moe_mlp(
            x, w, e, self.gate_up[...], self.down[...], first, act=self.act
        )
        out = experts_over_ranks(run, x, weights, experts, self.config)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return sum_over_shards(out, self.num_shards)  # [T, D]
