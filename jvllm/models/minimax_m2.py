"""MiniMax-M2 (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1) on Llama's pre-norm blocks, read as HF's
modeling_minimax_m2.py runs it:

- q and k RMS-normed over their whole projection (all heads at once: OLMo 2's norms,
  models/olmo2.py), before rotary embeddings on the first `rotary_dim` of each head
  (rotate-half pairing);
- a mixture of experts in every layer, chosen by sigmoid scores plus a correction bias
  (DeepSeek-V3's router with one group, layers/deepseek_moe.py), the top k renormalised,
  no shared expert; the checkpoints name the experts as Mixtral's (block_sparse_moe.experts.j.
  w1 / w3 / w2), `intermediate_size` their width;
- the multi-token-prediction modules the checkpoints may keep are not part of the model.
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.deepseek_moe import DeepseekMoE
from jvllm.models.deepseek import check_routing
from jvllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jvllm.models.mixtral import MixtralForCausalLM
from jvllm.models.olmo2 import Olmo2Attention
from jvllm.models.weights import CheckpointWeights, is_after_last_layer
from jvllm.rope_config import ROTARY_FRACTION_KEY, hf_partial_rotary_factor

# What MiniMaxM2Config assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 196608,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 200034,
    "eos_token_id": 200020,
    "num_experts_per_tok": 8,
    "num_local_experts": 256,
}
_ROPE_THETA = 5_000_000.0  # MiniMaxM2Config's default_theta
# The released config.json's settings of what HF's model always does, and the values allowed.
_FIXED = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid"}


def _normalize(cfg: dict) -> dict:
    cfg = {**_DEFAULTS, **cfg}
    for name, allowed in _FIXED.items():
        if cfg.get(name, allowed) != allowed:
            raise ValueError(f"{name}={cfg[name]!r} is not supported; allowed: {allowed!r}")
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        cfg["rope_theta"] = _ROPE_THETA
    rotary_dim = cfg.get("rotary_dim")
    fraction = rotary_dim / cfg["head_dim"] if rotary_dim else hf_partial_rotary_factor(cfg)
    cfg[ROTARY_FRACTION_KEY] = fraction
    cfg["qk_norm"] = False  # no per-head norms: Olmo2Attention's over all heads
    cfg["n_routed_experts"] = cfg["num_experts"] = cfg["num_local_experts"]
    cfg.update(n_group=1, topk_group=1, norm_topk_prob=True)
    check_routing(cfg, "noaux_tc")
    cfg["moe_intermediate_size"] = cfg["intermediate_size"]
    options = {"routing": "noaux_tc", "n_group": 1, "topk_group": 1}
    cfg["options"] = {**cfg.get("options", {}), **options}
    return LlamaForCausalLM.normalize_hf_config(cfg)


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    attention = Olmo2Attention
    moe = DeepseekMoE


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    decoder_layer = MiniMaxM2DecoderLayer
    normalize_hf_config = staticmethod(_normalize)

    @staticmethod
    def is_read_elsewhere(config: ModelConfig, name: str) -> bool:
        """Whether the checkpoint's tensor `name` is a multi-token-prediction layer's (after
        the last; those named mtp the loader never reports), which no output reads."""
        return is_after_last_layer(name, config.num_layers)

    @staticmethod
    def load_layer_weights(config: ModelConfig, weights: CheckpointWeights, attn: tuple) -> None:
        LlamaForCausalLM.load_layer_weights(config, weights, attn)
        weights.stacked("layers.attn.q_norm.weight", ("self_attn.q_norm.weight",))
        weights.stacked("layers.attn.k_norm.weight", ("self_attn.k_norm.weight",))

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        MixtralForCausalLM.load_mlp_weights(config, weights)  # the router, the experts
        bias = "block_sparse_moe.e_score_correction_bias"
        weights.stacked("layers.mlp.correction_bias", (bias,))
