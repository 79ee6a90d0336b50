"""The decoder layer of the LayerNorm families with rotary embeddings (GPT-NeoX, Phi, Starcoder2,
StableLM, GPT-J, Cohere): LayerNorm (with bias, or Cohere's without) before attention and the
MLP, rotary embeddings over all or the first part of each head, and three ways to join the
residual stream (RESIDUALS).

What differs between the families travels in the config's options (`decoder_options`), so that
one layer class, one scan body, serves them all.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.mlp import MLP, GatedMLP
from jvllm.layers.norm import LayerNorm, layer_norm
from jvllm.layers.params import param

# How a layer adds its attention and MLP outputs to the residual stream x:
# "sequential": x += attn(ln1(x)), then x += mlp(ln2(x))   (Starcoder2, StableLM, Pythia-style
#               GPT-NeoX with use_parallel_residual=False);
# "parallel": x + attn(ln1(x)) + mlp(ln2(x))              (GPT-NeoX, Pythia);
# "parallel_shared_norm": x + attn(ln1(x)) + mlp(ln1(x))  (Phi, StableLM's parallel variant,
#                         GPT-J, Cohere).
RESIDUALS = ("sequential", "parallel", "parallel_shared_norm")
# The q/k norms, applied per head before rotary embeddings:
# "shared": one LayerNorm over H (weight and bias [H]) for every head (Phi's qk_layernorm);
# "per_head": a LayerNorm over H without bias, each head with its own weight (StableLM's,
#             Cohere's use_qk_norm).
QK_LAYERNORMS = ("shared", "per_head")


def decoder_options(
    *,
    residual: str,
    mlp_bias: bool,
    o_proj_bias: bool,
    qk_layernorm: str | None = None,
    is_gated_mlp: bool = False,
    lm_head_bias: bool = False,
    norm_bias: bool = True,
) -> dict:
    """The options (ModelConfig.option) a family's normalize_hf_config sets for this layer and
    for models/layer_norm_rotary.py's LM head; `norm_bias` False: every LayerNorm of the
    model (the layers' and the final one) has a weight and no bias (Cohere's)."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual={residual!r} is not one of {RESIDUALS}")
    if qk_layernorm is not None and qk_layernorm not in QK_LAYERNORMS:
        raise ValueError(f"qk_layernorm={qk_layernorm!r} is not one of {QK_LAYERNORMS}")
    return {
        "residual": residual,
        "mlp_bias": mlp_bias,
        "o_proj_bias": o_proj_bias,
        "qk_layernorm": qk_layernorm,
        "is_gated_mlp": is_gated_mlp,
        "lm_head_bias": lm_head_bias,
        "norm_bias": norm_bias,
    }


class HeadLayerNorm(nnx.Module):
    """LayerNorm of x [T, n, H] over H, without bias, each of the n heads with its own weight:
    one flat float32 weight [n*H], as the checkpoint's per-head tensors concatenate. Under tensor
    parallelism it is cut head by head with q|k|v (KV heads repeated where fewer than the
    devices), so each device holds its own heads' weights."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, axis: str):
        segments = ((num_heads, head_dim),)
        self.weight = param((num_heads * head_dim,), jnp.float32, (axis,), segments)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.weight[...].reshape(self.num_heads, self.head_dim)  # [n, H]
        return layer_norm(x, None, None, self.eps) * weight  # [T, n, H]


def _qk_layernorms(config: ModelConfig) -> tuple[nnx.Module, nnx.Module] | None:
    """The (q, k) norms of the config's `qk_layernorm` kind (QK_LAYERNORMS), or None."""
    kind, h, eps = config.option("qk_layernorm"), config.head_dim, config.rms_norm_eps
    if kind == "shared":
        return LayerNorm(h, eps, axis="head_dim"), LayerNorm(h, eps, axis="head_dim")
    if kind == "per_head":
        return (
            HeadLayerNorm(config.num_heads, h, eps, "heads"),
            HeadLayerNorm(config.num_kv_heads, h, eps, "kv_heads"),
        )
    return None


class LayerNormRotaryAttention(Attention):
    """Attention with rotary embeddings, biases as the config says, and the LayerNorm q/k norms
    of QK_LAYERNORMS (config.qk_norm, Qwen3's RMSNorm, is never set for these families)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, output_bias=config.option("o_proj_bias"))
        norms = _qk_layernorms(config)
        if norms is not None:
            # nnx.data: the base class left these None, which nnx took for static attributes.
            self.q_norm, self.k_norm = nnx.data(norms[0]), nnx.data(norms[1])


class LayerNormRotaryDecoderLayer(nnx.Module):
    """One layer on the float32 residual stream, its residual one of RESIDUALS; the MLP plain
    (up, act, down; biased where `mlp_bias`) or gated (StableLM's, without biases)."""

    def __init__(self, config: ModelConfig):
        d, eps = config.hidden_size, config.rms_norm_eps
        residual, bias = config.option("residual"), config.option("norm_bias", True)
        self.attn_norm = LayerNorm(d, eps, bias=bias)
        self.attn = LayerNormRotaryAttention(config)
        is_shared_norm = residual == "parallel_shared_norm"
        self.mlp_norm = None if is_shared_norm else LayerNorm(d, eps, bias=bias)
        if config.option("is_gated_mlp"):
            self.mlp = GatedMLP(config)
        else:
            self.mlp = MLP(config, bias=config.option("mlp_bias"))
        self.is_parallel = residual != "sequential"

    def __call__(self, x, layer, cos, sin, window, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache); window: None or this layer's i32[] W."""
        x_normed = self.attn_norm(x)  # [T, D]
        out, kv_cache = self.attn(x_normed, layer, cos, sin, kv_cache, metadata, attn, window)
        if not self.is_parallel:
            x = x + out
            return x + self.mlp(self.mlp_norm(x)), kv_cache
        mlp_in = x_normed if self.mlp_norm is None else self.mlp_norm(x)
        return x + out + self.mlp(mlp_in), kv_cache
