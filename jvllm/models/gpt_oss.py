"""gpt-oss (GptOssForCausalLM) as HF transformers runs it: Llama's pre-norm blocks with biases
on q/k/v/o, attention sinks (a learned logit per query head that joins each query's softmax
with no value), alternate sliding-window and global layers, YaRN rope, and a mixture of experts
with a biased router and clamped-SwiGLU experts (layers/gpt_oss_moe.py).

The released checkpoints store the experts MXFP4-packed (quantization_config quant_method
"mxfp4"); the loader dequantizes them to the model dtype (model_loader/mxfp4.py).
"""

from __future__ import annotations

from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.gpt_oss_moe import GptOssMoE, split_interleaved
from jvllm.layers.norm import RMSNorm
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights

# GptOssConfig's defaults, where a config.json does not say.
_DEFAULTS = {
    "num_key_value_heads": 8,
    "num_experts_per_tok": 4,
    "head_dim": 64,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
_DEFAULT_NUM_EXPERTS = 128  # num_local_experts, which HF also reads as num_experts
_DEFAULT_ROPE_THETA = 150000.0
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_QUANT_METHODS = ("mxfp4",)  # of a checkpoint's quantization_config; None: float weights


class GptOssDecoderLayer(nnx.Module):
    """A pre-norm block on the float32 residual stream: sinked attention, then the experts."""

    def __init__(self, config: ModelConfig):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, output_bias=config.option("o_proj_bias", False))
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMoE(config)

    def __call__(self, x, layer, cos, sin, window, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache); window: None or this layer's i32[] W."""
        x_normed = self.input_norm(x)
        out, kv_cache = self.attn(x_normed, layer, cos, sin, kv_cache, metadata, attn, window)
        x = x + out
        return x + self.mlp(self.post_attention_norm(x)), kv_cache


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        """GptOssConfig's reading of a config.json: its defaults (YaRN rope of base 150000,
        layer_types alternating sliding and full from layer 0), each expert's F in
        intermediate_size, and hidden_act unread (the experts' activation is fixed)."""
        cfg = {**_DEFAULTS, **cfg}
        cfg.setdefault("num_local_experts", cfg.get("num_experts", _DEFAULT_NUM_EXPERTS))
        _check_quantization(cfg.get("quantization_config"))
        if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
            cfg["rope_parameters"] = dict(_DEFAULT_ROPE)
        if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
            cfg["rope_theta"] = _DEFAULT_ROPE_THETA
        if not cfg.get("layer_types"):
            cfg["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(cfg["num_hidden_layers"])
            ]
        if "sliding_attention" in cfg["layer_types"] and not cfg.get("sliding_window"):
            raise ValueError(
                f"sliding_window={cfg.get('sliding_window')!r} with sliding_attention layers is "
                "not supported; allowed: a positive int, or only full_attention layers"
            )
        cfg.pop("hidden_act", None)
        cfg["moe_intermediate_size"] = cfg["intermediate_size"]
        cfg["options"] = {
            **cfg.get("options", {}),
            "attention_sinks": True,
            "o_proj_bias": bool(cfg["attention_bias"]),  # HF's attention_bias is on o_proj too
            "swiglu_alpha": float(cfg["swiglu_alpha"]),
            "swiglu_limit": float(cfg["swiglu_limit"]),
        }
        return cfg

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        super().load_weights(config, weights)
        weights.stacked("layers.attn.sinks", ("self_attn.sinks",))

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        """The router and the experts; an MXFP4 checkpoint's experts come dequantized from the
        loader under the same names (model_loader/mxfp4.py)."""
        weights.stacked("layers.mlp.router", ("mlp.router.weight",))
        weights.stacked("layers.mlp.router_bias", ("mlp.router.bias",))
        experts = "mlp.experts."
        gate_up, down = experts + "gate_up_proj", experts + "down_proj"
        weights.stacked("layers.mlp.gate_up", (gate_up,), transform=split_interleaved)
        weights.stacked("layers.mlp.gate_up_bias", (gate_up + "_bias",), split_interleaved)
        weights.stacked("layers.mlp.down", (down,))
        weights.stacked("layers.mlp.down_bias", (down + "_bias",))


def _check_quantization(quantization: dict | None) -> None:
    """A checkpoint's quantization_config: none, or MXFP4, which the loader dequantizes."""
    method = (quantization or {}).get("quant_method")
    if quantization and method not in _QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported for gpt-oss; "
            f"allowed: {_QUANT_METHODS} (dequantized at load) or no quantization_config"
        )
