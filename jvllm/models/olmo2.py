"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM) as flax.nnx modules.

Llama's projections and gated MLP, arranged differently (HF's modeling_olmo2.py):
- no norm before attention or the MLP: each block's output is normed, then added to the
  residual stream;
- q and k are RMS-normed over their whole projection (all N, or all K, heads at once, one
  weight [N*H], [K*H]), not head by head as Qwen3's;
- OLMo 3 windows three layers of four, and its windowed layers rotate without the rope scaling
  the global ones have (the local cos/sin set, as Gemma 3's; docs/design.md, "Layer scan").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import check_activation
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.norm import RMSNorm
from jvllm.layers.parallel import sum_over_shards
from jvllm.layers.params import param
from jvllm.layers.rotary_layers import run_rotary_layers
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights

# What Olmo2Config and Olmo3Config assume where a config.json says nothing.
_DEFAULTS = {"rms_norm_eps": 1e-5, "eos_token_id": 50279}
_OLMO3_DEFAULTS = {"sliding_window": 4096}
_OLMO3_ROPE_THETA = 500_000.0
_OLMO3_GLOBAL_PERIOD = 4  # every 4th layer attends globally, the others in their window


def _normalize(cfg: dict) -> dict:
    """The config as Olmo2Config / Olmo3Config read it. OLMo 3's transformers 4 layout keeps
    one rope_theta and a rope_scaling that HF applies to the global layers only: the windowed
    ones get that theta unscaled, as the local rope (HF 5 gives them its default 500000
    instead, which only a checkpoint with another theta would notice)."""
    architecture = (cfg.get("architectures") or [None])[0]
    is_olmo3 = architecture == "Olmo3ForCausalLM" or cfg.get("model_type") == "olmo3"
    cfg = {**_DEFAULTS, **(_OLMO3_DEFAULTS if is_olmo3 else {}), **cfg}
    cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "silu"), "hidden_act")
    if not is_olmo3:
        # HF's OLMo 2 attends globally, whatever its config says.
        cfg["sliding_window"] = None
        return cfg
    if not cfg.get("layer_types"):
        period = _OLMO3_GLOBAL_PERIOD
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", _OLMO3_ROPE_THETA))
    if "full_attention" not in rope:
        # transformers 4's layout: the scaling is the global layers' only.
        cfg["rope_theta"] = theta
        cfg["rope_local_base_freq"] = theta
    return cfg


def _has_local_rope(config: ModelConfig) -> bool:
    """Whether the windowed layers rotate otherwise than the global ones."""
    return config.local_rope_theta is not None and (
        config.rope_scaling is not None or config.local_rope_theta != config.rope_theta
    )


class WholeRMSNorm(nnx.Module):
    """RMSNorm of x [T, n, H] over all its n heads at once, weight [n*H]. Under tensor
    parallelism each device holds some heads: the mean of squares is the mean of the devices'
    means, which holds too where KV heads repeat (each repeated as often)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, axis: str, num_shards: int):
        # Segments: cut head by head, KV heads repeated where fewer than the devices.
        segments = ((num_heads, head_dim),)
        self.weight = param((num_heads * head_dim,), jnp.float32, (axis,), segments)
        self.eps = eps
        self.num_shards = num_shards

    def __call__(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(x.shape[0], -1).astype(jnp.float32)  # [T, n*H]
        mean_square = jnp.mean(jnp.square(flat), axis=-1, keepdims=True)  # [T, 1]
        mean_square = sum_over_shards(mean_square, self.num_shards) / self.num_shards
        out = flat * jax.lax.rsqrt(mean_square + self.eps) * self.weight[...]
        return out.reshape(x.shape)


class Olmo2Attention(Attention):
    """Attention whose q and k norms (applied where Qwen3's are, before rope) span all heads."""

    def __init__(self, config: ModelConfig):
        # config.qk_norm is False: no per-head norms are made. attention_bias: on q/k/v and o.
        super().__init__(config, output_bias=config.attention_bias)
        eps, h, shards = config.rms_norm_eps, config.head_dim, config.num_shards
        # nnx.data: the base class left these None, which nnx took for static attributes.
        self.q_norm = nnx.data(WholeRMSNorm(config.num_heads, h, eps, "heads", shards))
        self.k_norm = nnx.data(WholeRMSNorm(config.num_kv_heads, h, eps, "kv_heads", shards))


class Olmo2DecoderLayer(nnx.Module):
    """A post-norm block: x + norm(attn(x)), then x + norm(mlp(x)), on the float32 stream."""

    attention = Olmo2Attention  # a family with other q/k norms (EXAONE 4's per head) sets its own

    def __init__(self, config: ModelConfig):
        self.attn = self.attention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)
        self.post_mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def __call__(self, x, layer, cos, sin, window, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache); window: None or this layer's i32[] W."""
        out, kv_cache = self.attn(x, layer, cos, sin, kv_cache, metadata, attn, window)
        x = x + self.post_attention_norm(out)
        return x + self.post_mlp_norm(self.mlp(x)), kv_cache


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Olmo2ForCausalLM and Olmo3ForCausalLM: Llama's embedding, final norm and LM head around
    OLMo's blocks; OLMo 3's windows read from the config."""

    decoder_layer = Olmo2DecoderLayer

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        return _normalize(cfg)

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn):
        """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache)."""
        config = self.config
        x = self.embed(token_ids)  # [T, D]
        local_layers = None
        if _has_local_rope(config):  # OLMo 3: the windowed layers rotate without the scaling
            local_layers = [t == "sliding_attention" for t in config.layer_types]
        x, kv_cache = run_rotary_layers(
            self.layers, x, kv_cache, positions, config, metadata, attn, local_layers=local_layers
        )
        return self.final_norm(x), kv_cache

    @staticmethod
    def load_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params."""
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        weights.tensor("embed.embedding", "model.embed_tokens.weight")
        weights.stacked("layers.attn.qkv.weight", tuple(n + ".weight" for n in attn))
        weights.stacked("layers.attn.q_norm.weight", ("self_attn.q_norm.weight",))
        weights.stacked("layers.attn.k_norm.weight", ("self_attn.k_norm.weight",))
        weights.stacked("layers.attn.o.weight", ("self_attn.o_proj.weight",))
        if config.attention_bias:
            weights.stacked("layers.attn.qkv.bias", tuple(n + ".bias" for n in attn))
            weights.stacked("layers.attn.o.bias", ("self_attn.o_proj.bias",))
        weights.stacked("layers.post_attention_norm.weight", ("post_attention_layernorm.weight",))
        weights.stacked("layers.mlp.gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        weights.stacked("layers.mlp.down.weight", ("mlp.down_proj.weight",))
        weights.stacked("layers.post_mlp_norm.weight", ("post_feedforward_layernorm.weight",))
        weights.tensor("final_norm.weight", "model.norm.weight")
        if not config.tie_word_embeddings:
            weights.tensor("lm_head.weight", "lm_head.weight")
