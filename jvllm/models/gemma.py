"""Gemma, Gemma 2 and Gemma 3 (text) decoders as flax.nnx modules.

What sets them apart from Llama (models/llama.py), as HF transformers and vLLM run them:
- every RMSNorm scales by (1 + weight); the embeddings are scaled by sqrt(D), the factor rounded
  to the model dtype first; the LM head is the embedding; the MLP is GeGLU (tanh GeLU);
- Gemma 2 and 3 norm the attention's and the MLP's outputs too (four norms a layer), scale the
  scores by query_pre_attn_scalar^-1/2, and alternate sliding-window and global layers (Gemma 2
  one to one, Gemma 3 five to one); Gemma 2 soft-caps the attention scores and the logits;
- Gemma 3 norms q and k, and its windowed layers use their own rope base (without the global
  layers' scaling).
The per-layer differences are data the layer scan slices (a window and a local-rope flag per
layer), so the layers stay one scanned body (docs/design.md, "Layer scan").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.embedding import Embed
from jvllm.layers.linear import Linear
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.norm import RMSNorm
from jvllm.layers.rotary_layers import run_rotary_layers
from jvllm.layers.scan import stacked_layers
from jvllm.models.weights import CheckpointWeights

# The defaults of HF's config classes: a config.json may leave out any field it does not change.
_COMMON_DEFAULTS = {
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "attention_bias": False,
}
_DEFAULTS = {
    "gemma": {
        **_COMMON_DEFAULTS,
        "vocab_size": 256000,
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
    },
    "gemma2": {
        **_COMMON_DEFAULTS,
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {
        **_COMMON_DEFAULTS,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,  # every 6th layer global
        "final_logit_softcapping": None,
    },
}
_MODEL_TYPES = {
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3_text",
}


def _normalize(cfg: dict) -> dict:
    architecture = (cfg.get("architectures") or [None])[0]
    model_type = _MODEL_TYPES.get(architecture, cfg.get("model_type"))
    if model_type == "gemma3":  # a multimodal config built in code, without architectures
        model_type = "gemma3_text"
    cfg = {**_DEFAULTS[model_type], **cfg}  # an explicit null (no window, no cap) stays
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention=True (an embedding model) is not supported: jvllm runs "
            "causal language models"
        )
    if model_type == "gemma":
        # As HF's GemmaConfig: `hidden_act` decides (`hidden_activation` is no field of it),
        # and its "gelu", which Gemma's first configs said for what was trained as the tanh
        # approximation, means tanh.
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        cfg["hidden_act"] = "gelu_pytorch_tanh" if act == "gelu" else act
        for name in ("sliding_window", "layer_types", "query_pre_attn_scalar"):
            cfg.pop(name, None)
        cfg.pop("final_logit_softcapping", None)
        cfg.pop("attn_logit_softcapping", None)
        return cfg
    cfg["hidden_act"] = cfg["hidden_activation"]
    cfg["options"] = {"post_norms": True}
    num_layers = cfg["num_hidden_layers"]
    if model_type == "gemma2":
        period = 2
    else:
        # Neither HF nor vLLM soft-caps Gemma 3's attention scores, whatever its config says.
        cfg.pop("attn_logit_softcapping", None)
        cfg["qk_norm"] = True
        period = cfg.get("_sliding_window_pattern") or cfg["sliding_window_pattern"]
    if not cfg.get("layer_types"):
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    return cfg


class GemmaDecoderLayer(nnx.Module):
    """Gemma's pre-norm block; with `post_norms` (Gemma 2, 3) the attention's and the MLP's
    outputs are normed too before they join the float32 residual stream."""

    def __init__(self, config: ModelConfig):
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, weight_offset=1.0)
        has_post_norms = config.option("post_norms", False)
        self.input_norm = norm()
        # attention_bias: on q/k/v and o, as HF's.
        self.attn = Attention(config, norm_weight_offset=1.0, output_bias=config.attention_bias)
        self.post_attention_norm = norm()  # Gemma: before the MLP (HF's name for both)
        self.pre_mlp_norm = norm() if has_post_norms else None
        self.post_mlp_norm = norm() if has_post_norms else None
        self.mlp = GatedMLP(config)

    def __call__(self, x, layer, cos, sin, window, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache); window: None or this layer's i32[] W."""
        x_normed = self.input_norm(x)
        out, kv_cache = self.attn(x_normed, layer, cos, sin, kv_cache, metadata, attn, window)
        if self.pre_mlp_norm is None:
            x = x + out
            return x + self.mlp(self.post_attention_norm(x)), kv_cache
        x = x + self.post_attention_norm(out)
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x))), kv_cache


class GemmaForCausalLM(nnx.Module):
    """GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM: one module, the differences
    read from the config."""

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        return _normalize(cfg)

    def __init__(self, config: ModelConfig):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.embed = Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, num_shards=config.num_shards
        )
        self.layers = stacked_layers(lambda: GemmaDecoderLayer(config), config.num_layers)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_offset=1.0)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, ("vocab", "embed"), dtype=dtype)
        )

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn, mm=None):
        """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache); `mm`:
        Gemma 3's step image embeddings (None: a step of text), which go in unscaled: HF
        scales the token embeddings before they replace the image tokens'."""
        x = self.embed_tokens(token_ids)
        if mm is not None:
            x = mm.merge(x)
        return self.decode(kv_cache, x, positions, metadata, attn)

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        """token_ids i32[T] -> the first layer's input f32[T, D]: the embeddings times
        sqrt(D), which HF and vLLM round to the model dtype (bfloat16 sqrt(3072) = 55.5, not
        55.43): the checkpoints were trained with that factor."""
        normalizer = jnp.asarray(self.config.hidden_size**0.5, jnp.float32)
        return self.embed(token_ids) * normalizer.astype(self.config.dtype).astype(jnp.float32)

    def decode(self, kv_cache, x, positions, metadata, attn: AttentionFn):
        """The layers and the final norm over the first layer's input x f32[T, D] -> (hidden,
        kv_cache)."""
        config = self.config
        local_layers = None
        if config.local_rope_theta is not None:  # Gemma 3: the windowed layers' own base
            local_layers = [t == "sliding_attention" for t in config.layer_types]
        x, kv_cache = run_rotary_layers(
            self.layers, x, kv_cache, positions, config, metadata, attn, local_layers=local_layers
        )
        return self.final_norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden f32[S, D] (already final-normed) -> logits f32[S, V], soft-capped (Gemma 2)
        to cap * tanh(logits / cap)."""
        if self.lm_head is None:
            logits = self.embed.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    @staticmethod
    def load_weights(
        config: ModelConfig, weights: CheckpointWeights, prefix: str = "model."
    ) -> None:
        """The HF checkpoint's tensors into this module's params; the decoder's under `prefix`."""
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        weights.set_layer_prefix(prefix + "layers.{}.")
        weights.tensor("embed.embedding", prefix + "embed_tokens.weight")
        weights.stacked("layers.input_norm.weight", ("input_layernorm.weight",))
        weights.stacked("layers.attn.qkv.weight", tuple(n + ".weight" for n in attn))
        if config.qk_norm:
            weights.stacked("layers.attn.q_norm.weight", ("self_attn.q_norm.weight",))
            weights.stacked("layers.attn.k_norm.weight", ("self_attn.k_norm.weight",))
        weights.stacked("layers.attn.o.weight", ("self_attn.o_proj.weight",))
        if config.attention_bias:
            weights.stacked("layers.attn.qkv.bias", tuple(n + ".bias" for n in attn))
            weights.stacked("layers.attn.o.bias", ("self_attn.o_proj.bias",))
        weights.stacked("layers.post_attention_norm.weight", ("post_attention_layernorm.weight",))
        if config.option("post_norms", False):
            weights.stacked("layers.pre_mlp_norm.weight", ("pre_feedforward_layernorm.weight",))
            weights.stacked("layers.post_mlp_norm.weight", ("post_feedforward_layernorm.weight",))
        weights.stacked("layers.mlp.gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        weights.stacked("layers.mlp.down.weight", ("mlp.down_proj.weight",))
        weights.tensor("final_norm.weight", prefix + "norm.weight")
        if not config.tie_word_embeddings:
            # Beside the decoder: "lm_head.weight", "language_model.lm_head.weight".
            weights.tensor("lm_head.weight", prefix.removesuffix("model.") + "lm_head.weight")
