"""The model around the LayerNorm rotary layers (layers/layer_norm_rotary_decoder.py): token
embedding, the layers under the rotary layer scan, a final LayerNorm, and an LM head tied to
the embedding or its own, with a bias where the family has one (Phi's, GPT-J's), its logits
scaled where the family scales them (Cohere's logit_scale).

GPT-NeoX (gpt_neox.py), Phi (phi.py), Starcoder2 (starcoder2.py), StableLM (stablelm.py),
GPT-J (gptj.py) and Cohere (cohere.py) subclass it with their config reading and checkpoint
names. The contract is in docs/design.md; the runner reaches the model through models/model.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import check_activation
from jvllm.layers.attention import AttentionFn
from jvllm.layers.embedding import Embed
from jvllm.layers.layer_norm_rotary_decoder import LayerNormRotaryDecoderLayer
from jvllm.layers.linear import Linear
from jvllm.layers.norm import LayerNorm
from jvllm.layers.params import param
from jvllm.layers.rotary_layers import run_rotary_layers
from jvllm.layers.scan import stacked_layers
from jvllm.models.weights import CheckpointWeights

# torch's nn.LayerNorm default, which all four config classes take as theirs.
LAYER_NORM_EPS = 1e-5


def layer_norm_rotary_config(cfg: dict, *, eps_key: str, options: dict) -> dict:
    """Fields every family reads alike put in the layout model_config_from_hf reads: the
    LayerNorms' epsilon (under `eps_key`) as rms_norm_eps, the activation checked, no Qwen3 q/k
    RMSNorm, and the family's `options` (decoder_options)."""
    cfg["rms_norm_eps"] = cfg.get(eps_key, LAYER_NORM_EPS)
    cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "gelu"), "hidden_act")
    cfg["qk_norm"] = False
    cfg["options"] = {**cfg.get("options", {}), **options}
    return cfg


def whole_head_dim(cfg: dict) -> int:
    """hidden_size / num_attention_heads: the head size GPT-NeoX and StableLM compute (whatever
    a head_dim field says); ValueError where the heads do not divide the hidden size."""
    hidden_size, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} must be a multiple of num_attention_heads={num_heads}"
        )
    return hidden_size // num_heads


class LayerNormRotaryForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig):
        dtype = jnp.dtype(config.dtype)
        d, v = config.hidden_size, config.vocab_size
        has_bias = config.option("lm_head_bias", False)
        self.config = config
        self.embed = Embed(v, d, dtype=dtype, num_shards=config.num_shards)
        self.layers = stacked_layers(lambda: LayerNormRotaryDecoderLayer(config), config.num_layers)
        self.final_norm = LayerNorm(d, config.rms_norm_eps, bias=config.option("norm_bias", True))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(d, v, ("vocab", "embed"), dtype=dtype, bias=has_bias)
        )
        # A tied head's bias is a param of its own (PhiForCausalLM ties only the weight). It
        # is cut on the vocabulary with the embedding: the padded rows' bias is 0, and their
        # logits are dropped after the all-gather.
        is_own_bias = has_bias and config.tie_word_embeddings
        self.lm_head_bias = param((v,), jnp.float32, ("vocab",)) if is_own_bias else None

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn):
        """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache)."""
        config = self.config
        x = self.embed(token_ids)  # [T, D]
        # Cohere2's layers without rotary embeddings (None: every layer rotates).
        rope_layers = config.option("rope_layers")
        x, kv_cache = run_rotary_layers(
            self.layers, x, kv_cache, positions, config, metadata, attn, rope_layers=rope_layers
        )
        return self.final_norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden f32[S, D] (already final-normed) -> logits f32[S, V], times the family's
        `logit_scale` where it has one (Cohere's)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = self.embed.attend(hidden)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[...]
        scale = self.config.option("logit_scale")
        return logits if scale is None else logits * scale

    @classmethod
    def load_model_prefixed_input(cls, weights: CheckpointWeights, qkv_bias: bool) -> None:
        """Under HF's "model." names (Phi, Starcoder2, StableLM): the token embedding, each
        layer's input LayerNorm and its q, k and v projections, fused."""
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        weights.tensor("embed.embedding", "model.embed_tokens.weight")
        cls.load_layer_norm(weights, "layers.attn_norm", "input_layernorm")
        cls.load_linear(weights, "layers.attn.qkv", qkv, qkv_bias)

    @staticmethod
    def load_layer_norm(weights: CheckpointWeights, path: str, name: str) -> None:
        """The stacked LayerNorm at `path` from each layer's `name`.weight and `name`.bias."""
        for kind in ("weight", "bias"):
            weights.stacked(f"{path}.{kind}", (f"{name}.{kind}",))

    @staticmethod
    def load_linear(
        weights: CheckpointWeights, path: str, names: tuple[str, ...], bias: bool, transform=None
    ) -> None:
        """The stacked Linear at `path` from each layer's `names` (fused in order), with their
        biases where `bias`; `transform` applies to both."""
        for kind in ("weight", "bias") if bias else ("weight",):
            full_names = tuple(f"{n}.{kind}" for n in names)
            weights.stacked(f"{path}.{kind}", full_names, transform=transform)

    @staticmethod
    def load_head(
        config: ModelConfig, weights: CheckpointWeights, final_norm: str, lm_head: str = "lm_head"
    ) -> None:
        """The final LayerNorm (`final_norm`.weight, and .bias unless the family's norms have
        none) and the LM head: `lm_head`.weight unless tied, and `lm_head`.bias where the
        family has one."""
        weights.tensor("final_norm.weight", final_norm + ".weight")
        if config.option("norm_bias", True):
            weights.tensor("final_norm.bias", final_norm + ".bias")
        if not config.tie_word_embeddings:
            weights.tensor("lm_head.weight", lm_head + ".weight")
        if config.option("lm_head_bias", False):
            path = "lm_head_bias" if config.tie_word_embeddings else "lm_head.bias"
            weights.tensor(path, lm_head + ".bias")
