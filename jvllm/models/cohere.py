"""Cohere (CohereForCausalLM: Command-R, Aya) and Cohere2 (Cohere2ForCausalLM: Command-R7B) as
flax.nnx modules, on the LayerNorm rotary layers (models/layer_norm_rotary.py), read as HF's
modeling_cohere.py and modeling_cohere2.py run them:
- one LayerNorm feeding attention and the MLP in parallel: x + attn(ln(x)) + mlp(ln(x)); every
  LayerNorm (the layers' and the final one) mean-centred with a weight and no bias;
- rotary embeddings over whole heads, interleaved (dims 2i, 2i + 1 pair up; layers/rotary.py);
- `attention_bias` on q/k/v and the output projection; Llama's gated MLP without biases;
- Cohere's `use_qk_norm`: a LayerNorm over H without bias for each head of q and of k, each
  head with its own weight, before the rotary embeddings;
- the logits times `logit_scale`, the LM head tied to the embedding by default;
- Cohere2: `layer_types` (else every `sliding_window_pattern`-th layer global) windows the
  sliding layers, and ONLY those rotate: its global layers have no position embedding at all.
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.layer_norm_rotary_decoder import decoder_options
from jvllm.models.layer_norm_rotary import LayerNormRotaryForCausalLM, layer_norm_rotary_config
from jvllm.models.weights import CheckpointWeights

# What CohereConfig and Cohere2Config assume where a config.json says nothing.
_DEFAULTS = {
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "logit_scale": 0.0625,
    "tie_word_embeddings": True,
    "bos_token_id": 5,
    "eos_token_id": 255001,
}
_COHERE_ROPE_THETA = 500_000.0  # CohereConfig's; Cohere2Config keeps the usual 10000
_COHERE2_DEFAULTS = {"sliding_window": 4096}
_COHERE2_SLIDING_WINDOW_PATTERN = 4


def _is_cohere2(cfg: dict) -> bool:
    architecture = (cfg.get("architectures") or [None])[0]
    return architecture == "Cohere2ForCausalLM" or cfg.get("model_type") == "cohere2"


def _check_logit_scale(value) -> float:
    """HF's logits * logit_scale; None (which CohereConfig's type allows) would fail there."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value == 0:
        raise ValueError(f"logit_scale must be a nonzero number, got {value!r}")
    return float(value)


def _normalize_cohere2(cfg: dict) -> dict:
    """Cohere2's windows and rope as Cohere2Config and its attention read them: layer_types
    where given, else every `sliding_window_pattern`-th layer global; only the sliding layers
    rotate; head_dim is always hidden_size / num_attention_heads."""
    num_layers = cfg["num_hidden_layers"]
    if cfg.get("sliding_window") is None:
        raise ValueError(
            "sliding_window=None is not supported for Cohere2 (HF would run no rotary embedding "
            "on any layer); allowed: a positive int"
        )
    if not cfg.get("layer_types"):
        pattern = cfg.get("sliding_window_pattern", _COHERE2_SLIDING_WINDOW_PATTERN)
        cfg["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    rope_layers = tuple(t == "sliding_attention" for t in cfg["layer_types"])
    if not all(rope_layers):
        cfg["options"] = {**cfg.get("options", {}), "rope_layers": rope_layers}
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


class CohereForCausalLM(LayerNormRotaryForCausalLM):
    """CohereForCausalLM and Cohere2ForCausalLM."""

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        is_cohere2 = _is_cohere2(cfg)
        cfg = {**_DEFAULTS, **(_COHERE2_DEFAULTS if is_cohere2 else {}), **cfg}
        has_theta = "rope_theta" in cfg or "rope_theta" in (cfg.get("rope_parameters") or {})
        if not is_cohere2 and not has_theta:
            cfg["rope_theta"] = _COHERE_ROPE_THETA
        bias = bool(cfg.get("attention_bias"))
        cfg.update(attention_bias=bias, is_rope_interleaved=True)
        if is_cohere2:
            cfg = _normalize_cohere2(cfg)
        else:
            cfg["sliding_window"] = None  # HF's Cohere attends globally
        options = decoder_options(
            residual="parallel_shared_norm",
            mlp_bias=False,
            o_proj_bias=bias,
            qk_layernorm="per_head" if cfg.get("use_qk_norm") and not is_cohere2 else None,
            is_gated_mlp=True,
            norm_bias=False,
        )
        options["logit_scale"] = _check_logit_scale(cfg["logit_scale"])
        return layer_norm_rotary_config(cfg, eps_key="layer_norm_eps", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params."""
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        weights.tensor("embed.embedding", "model.embed_tokens.weight")
        weights.stacked("layers.attn_norm.weight", ("input_layernorm.weight",))
        cls.load_linear(weights, "layers.attn.qkv", qkv, config.attention_bias)
        if config.option("qk_layernorm"):
            # HF's per-head weights [N, H] (and [K, H]), flat as our [N*H].
            flat = lambda w: w.reshape(-1)
            weights.stacked("layers.attn.q_norm.weight", ("self_attn.q_norm.weight",), flat)
            weights.stacked("layers.attn.k_norm.weight", ("self_attn.k_norm.weight",), flat)
        cls.load_linear(weights, "layers.attn.o", ("self_attn.o_proj",), config.attention_bias)
        weights.stacked("layers.mlp.gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        weights.stacked("layers.mlp.down.weight", ("mlp.down_proj.weight",))
        cls.load_head(config, weights, "model.norm")
