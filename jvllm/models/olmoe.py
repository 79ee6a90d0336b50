"""OLMoE (OlmoeForCausalLM: OLMoE-1B-7B) as flax.nnx modules, read as HF's modeling_olmoe.py
runs it:
- Llama's pre-norm blocks, with biases on q/k/v and o where `attention_bias`;
- q and k RMS-normed over their whole projection (all N, or all K, heads at once), as OLMo 2's
  (models/olmo2.py), then, with `clip_qkv` c, q, k and v clamped to [-c, c] before rope;
- a sparse MoE MLP in every layer (layers/moe.py): softmax over all E router logits, the top-k
  weights renormalised to sum 1 only with `norm_topk_prob` (default False); no shared expert.
"""

from __future__ import annotations

from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.attention import Attention
from jvllm.models.layer_norm_rotary import whole_head_dim
from jvllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jvllm.models.olmo2 import WholeRMSNorm
from jvllm.models.qwen3_moe import Qwen3MoeForCausalLM
from jvllm.models.weights import CheckpointWeights

# What OlmoeConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "eos_token_id": 50279,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
}


def _normalize(cfg: dict) -> dict:
    """The config as OlmoeConfig reads it. HF sizes the q norm [D] and the k norm
    [D / N * K], so heads are D / N wide: a head_dim field saying otherwise is refused."""
    cfg = {**_DEFAULTS, **cfg}
    head_dim = whole_head_dim(cfg)
    if cfg.get("head_dim") not in (None, head_dim):
        raise ValueError(
            f"head_dim={cfg['head_dim']} is not supported for OLMoE; allowed: hidden_size / "
            f"num_attention_heads ({head_dim}), the width of HF's q/k norms"
        )
    clip = cfg.get("clip_qkv")
    is_number = isinstance(clip, int | float) and not isinstance(clip, bool)
    if clip is not None and not (is_number and clip > 0):
        raise ValueError(f"clip_qkv must be null or a number > 0, got {clip!r}")
    cfg = LlamaForCausalLM.normalize_hf_config(cfg)  # silu experts; o_proj's bias
    cfg.update(head_dim=head_dim, qk_norm=False, sliding_window=None)  # HF never windows
    if clip is not None:
        cfg["options"] = {**cfg.get("options", {}), "clip_qkv": float(clip)}
    return cfg


class OlmoeAttention(Attention):
    """Attention whose q and k norms span all heads (OLMo 2's WholeRMSNorm)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, output_bias=config.option("o_proj_bias", False))
        eps, h, shards = config.rms_norm_eps, config.head_dim, config.num_shards
        # nnx.data: the base class left these None, which nnx took for static attributes.
        self.q_norm = nnx.data(WholeRMSNorm(config.num_heads, h, eps, "heads", shards))
        self.k_norm = nnx.data(WholeRMSNorm(config.num_kv_heads, h, eps, "kv_heads", shards))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its MLP the experts) around OLMoE's attention."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.attn = OlmoeAttention(config)


class OlmoeForCausalLM(LlamaForCausalLM):
    decoder_layer = OlmoeDecoderLayer

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        return _normalize(cfg)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """Llama's tensors, the whole-projection q/k norms, and Qwen3-MoE's expert names."""
        super().load_weights(config, weights)
        weights.stacked("layers.attn.q_norm.weight", ("self_attn.q_norm.weight",))
        weights.stacked("layers.attn.k_norm.weight", ("self_attn.k_norm.weight",))

    # The router mlp.gate and the experts mlp.experts.{j}.{gate,up,down}_proj, as Qwen3-MoE's.
    load_mlp_weights = staticmethod(Qwen3MoeForCausalLM.load_mlp_weights)
