"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM: DeepSeek-V2, V2-Lite; DeepseekV3ForCausalLM:
DeepSeek-V3, R1, Kimi-K2): multi-head latent attention (layers/mla.py) and a mixture of experts
(layers/deepseek_moe.py) after `first_k_dense_replace` dense layers.

The layer scan runs one kind of layer, so the model holds two stacks, the dense layers then the
MoE layers, run one after the other; the second's layers keep their own KV-cache layer indices.

As HF's DeepseekV2/V3 models read their config.json:
- V2 routes by `topk_method` ("greedy" or "group_limited_greedy"), never renormalising the top-k
  weights; V3 always routes by sigmoid scores with e_score_correction_bias over n_group groups
  ("noaux_tc"), renormalising where `norm_topk_prob`; both scale by routed_scaling_factor;
- every layer from first_k_dense_replace on is MoE: HF ignores moe_layer_freq, which is refused
  unless 1 (DeepSeek's own code reads it);
- q_a_layernorm and kv_a_layernorm use eps 1e-6, not rms_norm_eps;
- the softmax scale is (qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)^2 where
  the rope scaling has a type and mscale_all_dim;
- V3's own FP8 release (block-scaled e4m3, quantization_config quant_method "fp8") loads as
  model_loader/quant_config.py reads it, its weights kept in fp8;
- V3's multi-token-prediction layer (num_nextn_predict_layers, saved after the last layer) is
  not part of this model (HF's skips it too): speculative decoding's "mtp" method loads it as a
  draft head (models/deepseek_mtp.py).

The KV cache holds MLA's latent (one row of kv_lora_rank + qk_rope_head_dim a token and layer),
or with JVLLM_MLA_DISABLE=1 (vLLM's VLLM_MLA_DISABLE) the decompressed per-head keys and values:
layers/mla.py.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import check_activation
from jvllm.layers.attention import AttentionFn
from jvllm.layers.deepseek_moe import DeepseekMoE
from jvllm.layers.embedding import Embed
from jvllm.layers.linear import Linear
from jvllm.layers.mla import MultiHeadLatentAttention
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.norm import RMSNorm
from jvllm.layers.rotary_layers import run_rotary_layers
from jvllm.layers.scan import stacked_layers
from jvllm.models.weights import CheckpointWeights, is_after_last_layer

# DeepseekV2Config's / DeepseekV3Config's defaults, where a config.json does not say.
_V2_DEFAULTS = {
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "moe_intermediate_size": 1407,
}
_V3_DEFAULTS = {
    **_V2_DEFAULTS,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "moe_intermediate_size": 2048,
    "rope_interleave": True,
}
_V2_ROUTINGS = ("greedy", "group_limited_greedy")
# Set to 1: the KV cache holds decompressed keys and values instead of the latent.
MLA_DISABLE_ENV = "JVLLM_MLA_DISABLE"
# The settings the layers read from config.option (the rest are ModelConfig fields).
_OPTIONS = (
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "rope_interleave",
    "routing",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "attention_multiplier",
)


def _is_v3(cfg: dict) -> bool:
    architectures = cfg.get("architectures") or []
    if architectures:
        return architectures[0] == "DeepseekV3ForCausalLM"
    return cfg.get("model_type") == "deepseek_v3"


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _softmax_scale(cfg: dict) -> float:
    """HF's `yarn_apply_mscale` on (qk_nope + qk_rope)^-1/2: the rope dict (rope_scaling where
    given, as rope_config reads it, else rope_parameters) with a type other than "default" and
    a mscale_all_dim multiplies it by mscale(factor, mscale_all_dim)^2."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def check_routing(cfg: dict, routing: str) -> None:
    """Raise ValueError where HF's router would fail or pick experts that cannot matter."""
    num_experts, top_k = cfg["n_routed_experts"], cfg.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"n_routed_experts must be a positive int, got {num_experts!r}")
    if not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k!r}")
    if routing == "greedy":
        return
    num_groups, topk_group = cfg.get("n_group"), cfg.get("topk_group")
    if not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"n_group must be a positive int dividing n_routed_experts={num_experts} for "
            f"routing {routing!r}, got {num_groups!r}"
        )
    group_size = num_experts // num_groups
    if not isinstance(topk_group, int) or not 0 < topk_group <= num_groups:
        raise ValueError(f"topk_group must be in [1, n_group={num_groups}], got {topk_group!r}")
    if top_k > topk_group * group_size:
        raise ValueError(
            f"num_experts_per_tok={top_k} is more than the {topk_group * group_size} experts of "
            f"topk_group={topk_group} groups of {group_size}; allowed: at most that many"
        )
    if routing == "noaux_tc" and group_size < 2:
        raise ValueError(
            f"n_group={num_groups} leaves groups of {group_size} expert, but V3's router scores "
            "each group by its two best; allowed: at least 2 experts a group"
        )


def _routing(cfg: dict, is_v3: bool) -> str:
    """The router HF runs (deepseek_moe.ROUTINGS), its settings checked."""
    if is_v3:
        routing = "noaux_tc"  # HF's V3 router, whatever topk_method says
    else:
        routing = cfg["topk_method"]
        if routing not in _V2_ROUTINGS:
            raise ValueError(
                f"topk_method={routing!r} is not supported for DeepseekV2ForCausalLM; allowed: "
                f"{_V2_ROUTINGS} (HF's V2 router knows no other)"
            )
        if cfg.get("norm_topk_prob"):
            raise ValueError(
                "norm_topk_prob=True is not supported for DeepseekV2ForCausalLM; allowed: "
                "False (HF's V2 router never renormalises, DeepSeek's own code does)"
            )
    check_routing(cfg, routing)
    return routing


def _is_latent_cache() -> bool:
    setting = os.environ.get(MLA_DISABLE_ENV, "0")
    if setting not in ("0", "1"):
        raise ValueError(f"{MLA_DISABLE_ENV}={setting!r}; allowed: '0', '1' or unset")
    return setting == "0"


def _normalize(cfg: dict) -> dict:
    is_v3 = _is_v3(cfg)
    cfg = {**(_V3_DEFAULTS if is_v3 else _V2_DEFAULTS), **cfg}
    num_heads = cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads") not in (None, num_heads):
        raise ValueError(
            f"num_key_value_heads={cfg['num_key_value_heads']} is not supported; allowed: "
            f"num_attention_heads ({num_heads}): MLA's latent serves every query head (and "
            "decompresses into a key and a value for each)"
        )
    cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "silu"), "hidden_act")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported; allowed: False")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(
            f"moe_layer_freq={cfg['moe_layer_freq']} is not supported; allowed: 1 (HF's "
            "DeepSeek models ignore it and make every layer from first_k_dense_replace MoE)"
        )
    cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    if cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]:
        cfg["routing"] = _routing(cfg, is_v3)
        cfg["num_experts"] = cfg["num_local_experts"] = cfg["n_routed_experts"]
        cfg["norm_topk_prob"] = bool(is_v3 and cfg.get("norm_topk_prob"))
        num_shared = cfg["n_shared_experts"] or 0
        cfg["shared_expert_intermediate_size"] = num_shared * cfg["moe_intermediate_size"]
    else:  # every layer dense: no expert is read
        cfg["num_experts"] = cfg["num_local_experts"] = cfg["num_experts_per_tok"] = 0
    qk_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    if cfg["qk_rope_head_dim"] < 2 or cfg["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim must be even and >= 2, got {cfg['qk_rope_head_dim']}")
    if _is_latent_cache():  # one KV head, one plane: the latent and the rope key (layers/mla.py)
        cfg["head_dim"] = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        cfg["num_key_value_heads"], cfg["kv_planes"] = 1, 1
    else:  # per-head keys and values, the shorter padded
        cfg["head_dim"] = max(qk_dim, cfg["v_head_dim"])
        cfg["num_key_value_heads"] = num_heads
    cfg["sliding_window"] = None
    cfg.pop("layer_types", None)
    cfg["rope_interleave"] = bool(cfg.get("rope_interleave", True)) if is_v3 else True
    cfg["attention_multiplier"] = _softmax_scale(cfg)
    cfg["options"] = {**cfg.get("options", {}), **{k: cfg.get(k) for k in _OPTIONS}}
    return cfg


def rotary_config(config: ModelConfig) -> ModelConfig:
    """The config the layers' rotary (cos, sin) are computed from: rotary embeddings turn the
    qk_rope_head_dim dims of a head, at their own frequencies."""
    rope_dim = config.option("qk_rope_head_dim")
    return dataclasses.replace(config, head_dim=rope_dim, partial_rotary_factor=1.0)


class DeepseekDecoderLayer(nnx.Module):
    """A pre-norm block: MLA, then a dense gated MLP or the experts."""

    def __init__(self, config: ModelConfig, is_moe: bool):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = MultiHeadLatentAttention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeepseekMoE(config) if is_moe else GatedMLP(config)

    def __call__(self, x, layer, cos, sin, window, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache); window: None (no layer has one)."""
        out, kv_cache = self.attn(self.input_norm(x), layer, cos, sin, kv_cache, metadata, attn)
        x = x + out
        return x + self.mlp(self.post_attention_norm(x)), kv_cache


class DeepseekForCausalLM(nnx.Module):
    normalize_hf_config = staticmethod(_normalize)

    def __init__(self, config: ModelConfig):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.num_dense = num_dense = config.option("first_k_dense_replace")
        num_moe = config.num_layers - num_dense
        self.embed = Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, num_shards=config.num_shards
        )
        make = lambda is_moe, n: stacked_layers(lambda: DeepseekDecoderLayer(config, is_moe), n)
        self.dense_layers = make(False, num_dense) if num_dense else None
        self.moe_layers = make(True, num_moe) if num_moe else None
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, ("vocab", "embed"), dtype=dtype)
        )

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn):
        """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache)."""
        x = self.embed(token_ids)  # [T, D]
        for stack, first_layer in ((self.dense_layers, 0), (self.moe_layers, self.num_dense)):
            if stack is not None:
                args = (stack, x, kv_cache, positions, rotary_config(self.config), metadata, attn)
                x, kv_cache = run_rotary_layers(*args, first_layer=first_layer)
        return self.final_norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden f32[S, D] (already final-normed) -> logits f32[S, V]."""
        return self.embed.attend(hidden) if self.lm_head is None else self.lm_head(hidden)

    @staticmethod
    def is_read_elsewhere(config: ModelConfig, name: str) -> bool:
        """Whether the checkpoint's tensor `name` is an MTP layer's (after the last layer),
        which speculative decoding's "mtp" method reads (models/deepseek_mtp.py)."""
        return is_after_last_layer(name, config.num_layers)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params, stack by stack."""
        weights.tensor("embed.embedding", "model.embed_tokens.weight")
        num_dense = config.option("first_k_dense_replace")
        if num_dense:
            weights.set_layers(0, num_dense)
            load_layers(config, weights, "dense_layers.", is_moe=False)
        if config.num_layers > num_dense:
            weights.set_layers(num_dense, config.num_layers - num_dense)
            load_layers(config, weights, "moe_layers.", is_moe=True)
        weights.tensor("final_norm.weight", "model.norm.weight")
        if not config.tie_word_embeddings:
            weights.tensor("lm_head.weight", "lm_head.weight")


def load_layers(config: ModelConfig, weights: CheckpointWeights, stack: str, is_moe: bool):
    """One stack's params (`stack`: its path prefix) from the layers weights.set_layers names."""
    layer = lambda path, *names: weights.stacked(stack + path, names)
    layer("input_norm.weight", "input_layernorm.weight")
    layer("post_attention_norm.weight", "post_attention_layernorm.weight")
    attn = "self_attn."
    if config.option("q_lora_rank") is None:
        layer("attn.q.weight", attn + "q_proj.weight")
    else:
        layer("attn.q_a.weight", attn + "q_a_proj.weight")
        layer("attn.q_a_norm.weight", attn + "q_a_layernorm.weight")
        layer("attn.q.weight", attn + "q_b_proj.weight")
    layer("attn.kv_a.weight", attn + "kv_a_proj_with_mqa.weight")
    layer("attn.kv_a_norm.weight", attn + "kv_a_layernorm.weight")
    layer("attn.kv_b.weight", attn + "kv_b_proj.weight")
    layer("attn.o.weight", attn + "o_proj.weight")
    if config.attention_bias:
        if config.option("q_lora_rank") is not None:
            layer("attn.q_a.bias", attn + "q_a_proj.bias")
        layer("attn.kv_a.bias", attn + "kv_a_proj_with_mqa.bias")
        layer("attn.o.bias", attn + "o_proj.bias")
    gated = "mlp.shared_experts." if is_moe else "mlp."  # the param's path and HF's name alike
    if not is_moe or config.shared_expert_intermediate_size:
        layer(gated + "gate_up.weight", gated + "gate_proj.weight", gated + "up_proj.weight")
        layer(gated + "down.weight", gated + "down_proj.weight")
    if not is_moe:
        return
    layer("mlp.router", "mlp.gate.weight")
    if config.option("routing") == "noaux_tc":
        layer("mlp.correction_bias", "mlp.gate.e_score_correction_bias")
    experts = "mlp.experts.{}."
    weights.stacked_experts(
        stack + "mlp.gate_up",
        (experts + "gate_proj.weight", experts + "up_proj.weight"),
        config.num_experts,
    )
    weights.stacked_experts(stack + "mlp.down", (experts + "down_proj.weight",), config.num_experts)
