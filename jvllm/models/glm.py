"""GLM (GlmForCausalLM: glm-4-9b) and GLM-4 (Glm4ForCausalLM: GLM-4-0414) as flax.nnx modules,
on Llama's (models/llama.py), read as HF's modeling_glm.py and modeling_glm4.py run them:
- Llama's RMSNorm pre-norm blocks, with biases on q/k/v (`attention_bias`, default True) and
  never on the output projection;
- rotary embeddings over the first `partial_rotary_factor` (default 0.5) of each head,
  interleaved within them (GLM's apply_rotary_pos_emb: dims 2i, 2i + 1 pair up, at frequency i
  of the rotated dims; layers/rotary.py);
- the gated MLP saved fused as gate_up_proj (gate first);
- GLM-4 norms each block's output before its residual add too: x + n2(attn(n1(x))), then
  x + n4(mlp(n3(x))) (post_self_attn_layernorm, post_mlp_layernorm).
"""

from __future__ import annotations

from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import check_activation
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.norm import RMSNorm
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights
from jvllm.rope_config import ROTARY_FRACTION_KEY, hf_partial_rotary_factor

# What GlmConfig and Glm4Config assume where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1.5625e-07,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "eos_token_id": [151329, 151336, 151338],
}
_PARTIAL_ROTARY_FACTOR = 0.5


class Glm4DecoderLayer(nnx.Module):
    """A pre-norm block whose attention and MLP outputs are RMS-normed again before each
    residual add, on the float32 stream."""

    def __init__(self, config: ModelConfig):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_norm = RMSNorm(d, eps)
        self.attn = Attention(config)
        self.post_self_attn_norm = RMSNorm(d, eps)
        self.post_attention_norm = RMSNorm(d, eps)
        self.mlp = GatedMLP(config)
        self.post_mlp_norm = RMSNorm(d, eps)

    def __call__(self, x, layer, cos, sin, window, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache); window: None or this layer's i32[] W."""
        x_normed = self.input_norm(x)
        out, kv_cache = self.attn(x_normed, layer, cos, sin, kv_cache, metadata, attn, window)
        x = x + self.post_self_attn_norm(out)
        return x + self.post_mlp_norm(self.mlp(self.post_attention_norm(x))), kv_cache


class GlmForCausalLM(LlamaForCausalLM):
    """GlmForCausalLM: Llama's modules (LlamaDecoderLayer) with GLM's config and names."""

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "silu"), "hidden_act")
        cfg[ROTARY_FRACTION_KEY] = hf_partial_rotary_factor(cfg, _PARTIAL_ROTARY_FACTOR)
        cfg.update(
            attention_bias=bool(cfg["attention_bias"]),  # q/k/v only: no o_proj_bias option
            is_rope_interleaved=True,
            sliding_window=None,  # HF's GLM attends globally
        )
        return cfg

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        weights.stacked("layers.mlp.gate_up.weight", ("mlp.gate_up_proj.weight",))
        weights.stacked("layers.mlp.down.weight", ("mlp.down_proj.weight",))


class Glm4ForCausalLM(GlmForCausalLM):
    """Glm4ForCausalLM: GLM's with the blocks' outputs normed (Glm4DecoderLayer)."""

    decoder_layer = Glm4DecoderLayer

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """GLM's tensors and each layer's two output norms."""
        super().load_weights(config, weights)
        weights.stacked("layers.post_self_attn_norm.weight", ("post_self_attn_layernorm.weight",))
        weights.stacked("layers.post_mlp_norm.weight", ("post_mlp_layernorm.weight",))
