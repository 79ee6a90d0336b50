"""GraniteMoE and GraniteMoeShared (GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM: Granite
3.0/3.1 MoE, PowerMoE) as flax.nnx modules, read as HF's modeling_granitemoe(shared).py runs
them:
- Llama's blocks with Granite's four scalings (models/llama.py, `_normalize_granite`);
- a sparse MoE MLP in every layer: the router ("router.layer") takes the top-k logits and a
  softmax over those k, which equals the top-k of a softmax over all E renormalised to sum 1
  (`route` with renormalisation); the experts saved fused, "input_linear" [E, 2F, D] (gate
  then up, HF's chunk order) and "output_linear" [E, D, F];
- GraniteMoeShared adds, with `shared_intermediate_size` > 0, a dense gated MLP
  ("shared_mlp.input_linear" [2S, D], "output_linear" [D, S]) that every token runs, added to
  the experts' sum without a gate.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.expert_counts import count_experts
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.moe import SparseMoE, route
from jvllm.layers.parallel import sum_over_shards
from jvllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, _normalize_granite
from jvllm.models.weights import CheckpointWeights

# What GraniteMoeConfig assumes where a config.json says nothing.
_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2}


def _in_out(w: np.ndarray) -> np.ndarray:
    """Fused experts [E, out, in] (torch's layout) -> [E, in, out] (ragged_dot's, moe.py)."""
    return np.swapaxes(w, 1, 2)


class UngatedSharedMoE(SparseMoE):
    """SparseMoE plus a shared gated MLP of width config.shared_expert_intermediate_size that
    every token runs, added as it is (Qwen2-MoE's shared expert has a sigmoid gate; Granite's
    has none). Its partial sum joins the experts' before their one all-reduce."""

    def __init__(self, config: ModelConfig):
        super().__init__(dataclasses.replace(config, shared_expert_intermediate_size=0))
        shared_f = config.shared_expert_intermediate_size
        # nnx.data: the base class left it None, which nnx took for a static attribute.
        self.shared_expert = nnx.data(GatedMLP(config, shared_f, sum_shards=False))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[T, D] -> f32[T, D]."""
        weights, experts = route(x, self.router[...], self.top_k, self.renormalize)
        count_experts(experts, self.num_experts)
        out = self.routed_experts(x, weights, experts)
        return sum_over_shards(out + self.shared_expert(x), self.num_shards)


class GraniteMoeDecoderLayer(LlamaDecoderLayer):
    """Llama's block with Granite's residual multiplier; its MLP the experts, with the shared
    MLP beside them where the config has one."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        if config.shared_expert_intermediate_size:
            self.mlp = UngatedSharedMoE(config)


class GraniteMoeForCausalLM(LlamaForCausalLM):
    decoder_layer = GraniteMoeDecoderLayer

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        architecture = (cfg.get("architectures") or [None])[0]
        is_shared = architecture == "GraniteMoeSharedForCausalLM" or (
            cfg.get("model_type") == "granitemoeshared"
        )
        cfg = {**_DEFAULTS, **cfg}
        cfg = _normalize_granite(LlamaForCausalLM.normalize_hf_config(cfg))
        shared_f = cfg.get("shared_intermediate_size", 0) if is_shared else 0
        if not isinstance(shared_f, int) or shared_f < 0:
            raise ValueError(f"shared_intermediate_size must be an int >= 0, got {shared_f!r}")
        # HF windows no layer; its router always renormalises the k weights (the softmax over
        # the top-k logits); the experts are intermediate_size wide.
        cfg.update(sliding_window=None, norm_topk_prob=True, moe_intermediate_size=0)
        cfg["shared_expert_intermediate_size"] = shared_f
        return cfg

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        moe = "block_sparse_moe."
        weights.stacked("layers.mlp.router", (moe + "router.layer.weight",))
        weights.stacked("layers.mlp.gate_up", (moe + "input_linear.weight",), transform=_in_out)
        weights.stacked("layers.mlp.down", (moe + "output_linear.weight",), transform=_in_out)
        if config.shared_expert_intermediate_size:
            shared, path = "shared_mlp.", "layers.mlp.shared_expert."
            weights.stacked(path + "gate_up.weight", (shared + "input_linear.weight",))
            weights.stacked(path + "down.weight", (shared + "output_linear.weight",))
