"""The decoder layer of the learned-position families (GPT-2, OPT): LayerNorm, attention with no
rotary embedding, a plain MLP, a bias on every projection or on none; pre-norm (GPT-2, most OPTs)
or post-norm (OPT-350m)."""

from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.mlp import MLP
from jvllm.layers.norm import LayerNorm


class LayerNormDecoderLayer(nnx.Module):
    """Pre-norm (`is_pre_norm`): x += attn(attn_norm(x)), then x += mlp(mlp_norm(x)).
    Post-norm: x = attn_norm(x + attn(x)), then x = mlp_norm(x + mlp(x)). The residual stream is
    float32; `config.attention_bias` biases the q|k|v, output and MLP projections alike."""

    def __init__(
        self, config: ModelConfig, *, is_pre_norm: bool = True, is_norm_affine: bool = True
    ):
        d, eps, bias = config.hidden_size, config.rms_norm_eps, config.attention_bias
        self.attn_norm = LayerNorm(d, eps, is_affine=is_norm_affine)
        self.attn = Attention(config, rope=False, output_bias=bias)
        self.mlp_norm = LayerNorm(d, eps, is_affine=is_norm_affine)
        self.mlp = MLP(config, bias=bias)
        self.is_pre_norm = is_pre_norm

    def __call__(self, x, layer, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] -> (x f32[T, D], kv_cache)."""
        if self.is_pre_norm:
            out, kv_cache = self.attn(
                self.attn_norm(x), layer, None, None, kv_cache, metadata, attn
            )
            x = x + out
            return x + self.mlp(self.mlp_norm(x)), kv_cache
        out, kv_cache = self.attn(x, layer, None, None, kv_cache, metadata, attn)
        x = self.attn_norm(x + out)
        return self.mlp_norm(x + self.mlp(x)), kv_cache
