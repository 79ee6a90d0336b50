"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6) on Llama's modules
(models/llama.py), read as HF's modeling_glm4_moe.py runs it:

- Llama's pre-norm blocks; q/k/v biases where `attention_bias` (o_proj never has one), per-head
  q/k RMSNorms where `use_qk_norm`;
- rotary embeddings on the first half of each head (`partial_rotary_factor`, 0.5 by default) in
  rotate-half pairing, not GLM-4's interleaved one;
- the first `first_k_dense_replace` layers a dense gated MLP (a stack of their own, run first),
  every later one DeepSeek-V3's mixture of experts (layers/deepseek_moe.py): sigmoid scores with
  e_score_correction_bias over n_group groups, renormalised where norm_topk_prob, scaled by
  routed_scaling_factor, beside n_shared_experts shared experts;
- the multi-token-prediction layer the checkpoints keep after the last layer
  (num_nextn_predict_layers) is not part of this model (HF's skips it too): speculative
  decoding's "mtp" method loads it as a draft head (models/glm4_moe_mtp.py).
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.deepseek_moe import DeepseekMoE
from jvllm.models.deepseek import check_routing
from jvllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jvllm.models.qwen3_moe import Qwen3MoeForCausalLM
from jvllm.models.weights import CheckpointWeights, is_after_last_layer
from jvllm.rope_config import ROTARY_FRACTION_KEY, hf_partial_rotary_factor

# What Glm4MoeConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
}
_DEFAULT_ROTARY_FRACTION = 0.5
_ROUTER_OPTIONS = ("routing", "n_group", "topk_group", "routed_scaling_factor")


def _normalize(cfg: dict) -> dict:
    cfg = {**_DEFAULTS, **cfg}
    for name in ("attention_bias", "use_qk_norm", "norm_topk_prob"):
        if cfg[name] is not True and cfg[name] is not False:
            raise ValueError(f"{name} must be true or false, got {cfg[name]!r}")
    qkv_bias = cfg.pop("attention_bias")  # Llama's would put one on o_proj too
    cfg["qk_norm"] = cfg.pop("use_qk_norm")
    cfg[ROTARY_FRACTION_KEY] = hf_partial_rotary_factor(cfg, _DEFAULT_ROTARY_FRACTION)
    cfg = LlamaForCausalLM.normalize_hf_config(read_v3_experts(cfg))
    cfg["attention_bias"] = qkv_bias
    return cfg


def read_v3_experts(cfg: dict) -> dict:
    """A config's DeepSeek-V3-routed experts (GLM-4.5's, dots.llm1's) as DeepseekMoE reads
    them: n_routed_experts chosen by sigmoid scores plus a correction bias over n_group groups,
    n_shared_experts beside them, in every layer from first_k_dense_replace on (the dense ones
    before as a stack of their own, LlamaForCausalLM's num_dense_layers)."""
    num_layers, num_dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    if isinstance(num_dense, bool) or not isinstance(num_dense, int) or num_dense < 0:
        raise ValueError(f"first_k_dense_replace must be an int >= 0, got {num_dense!r}")
    options = {}
    if num_dense < num_layers:
        cfg["routing"] = "noaux_tc"  # HF's routers (Glm4MoeTopkRouter's) are DeepSeek-V3's
        check_routing(cfg, cfg["routing"])
        cfg["num_experts"] = cfg["num_local_experts"] = cfg["n_routed_experts"]
        num_shared = cfg["n_shared_experts"] or 0
        cfg["shared_expert_intermediate_size"] = num_shared * cfg["moe_intermediate_size"]
        options = {name: cfg[name] for name in _ROUTER_OPTIONS}
        if num_dense:  # LlamaForCausalLM runs them as a stack of their own, first
            options["num_dense_layers"] = num_dense
    else:  # every layer dense: no expert is read
        cfg["num_experts"] = cfg["num_local_experts"] = cfg["num_experts_per_tok"] = 0
    cfg["options"] = {**cfg.get("options", {}), **options}
    return cfg


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    moe = DeepseekMoE


class Glm4MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = Glm4MoeDecoderLayer
    normalize_hf_config = staticmethod(_normalize)

    @staticmethod
    def is_read_elsewhere(config: ModelConfig, name: str) -> bool:
        """Whether the checkpoint's tensor `name` is an MTP layer's (after the last layer),
        which speculative decoding's "mtp" method reads (models/glm4_moe_mtp.py)."""
        return is_after_last_layer(name, config.num_layers)

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        load_moe_weights(config, weights, "mlp.gate.e_score_correction_bias")


def load_moe_weights(config: ModelConfig, weights: CheckpointWeights, correction_bias: str):
    """A stack's MLP where the config has experts: the router, its correction bias (the
    checkpoint's tensor `correction_bias`, [E] or ERNIE 4.5's [1, E]), the routed experts and
    the shared ones (layers/deepseek_moe.py); else the dense MLP."""
    if not config.num_experts:
        LlamaForCausalLM.load_mlp_weights(config, weights)
        return
    Qwen3MoeForCausalLM.load_mlp_weights(config, weights)  # the router, the experts
    weights.stacked("layers.mlp.correction_bias", (correction_bias,), lambda b: b.reshape(-1))
    if config.shared_expert_intermediate_size:
        shared = "mlp.shared_experts."
        weights.stacked(
            "layers." + shared + "gate_up.weight",
            (shared + "gate_proj.weight", shared + "up_proj.weight"),
        )
        weights.stacked("layers." + shared + "down.weight", (shared + "down_proj.weight",))
