"""Falcon (FalconForCausalLM: Falcon-7B, -40B, -180B, Falcon2-11B) as flax.nnx modules, on the
LayerNorm rotary layers (models/layer_norm_rotary.py), read as HF's modeling_falcon.py runs it:
- rotary embeddings over whole heads (D / N wide); `alibi` (Falcon-RW) is refused;
- one fused query_key_value projection whose rows hold, KV group by KV group, the group's
  G = N / K query heads, then its key head, then its value head ([K, G + 2, H]), reordered at
  load into q|k|v blocks. The three layouts of HF's `_split_heads` are all this one: the new
  decoder architecture's (K = num_kv_heads), multi_query's (K = 1: [N + 2, H]) and the
  per-head one without multi_query (K = N: [N, 3, H]);
- the 7B layout (`parallel_attn`, one `input_layernorm`): x + attn(ln(x)) + mlp(ln(x)), or
  sequential without `parallel_attn`; the new decoder architecture (40B/180B): separate
  `ln_attn` and `ln_mlp`, x + attn(ln_attn(x)) + mlp(ln_mlp(x)), or one `input_layernorm` for
  both with `num_ln_in_parallel_attn` 1 (Falcon2-11B);
- `bias` on every projection, LayerNorms always biased, a gelu MLP (dense_h_to_4h,
  dense_4h_to_h) of `ffn_hidden_size` (default 4D), an LM head tied to the embedding by default.
Falcon3 checkpoints are Llama's architecture and load as LlamaForCausalLM.
"""

from __future__ import annotations

import functools

import numpy as np

from jvllm.config import ModelConfig
from jvllm.layers.layer_norm_rotary_decoder import decoder_options
from jvllm.models.layer_norm_rotary import (
    LayerNormRotaryForCausalLM,
    layer_norm_rotary_config,
    whole_head_dim,
)
from jvllm.models.weights import CheckpointWeights

# What FalconConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "activation": "gelu",
    "alibi": False,
    "bias": False,
    "multi_query": True,
    "new_decoder_architecture": False,
    "parallel_attn": True,
    "tie_word_embeddings": True,
    "bos_token_id": 11,
    "eos_token_id": 11,
}
# Each residual (layers/layer_norm_rotary_decoder.py) -> its checkpoint's norms before attention
# and before the MLP (None: the one norm feeds both).
_NORMS = {
    "parallel_shared_norm": ("input_layernorm", None),
    "parallel": ("ln_attn", "ln_mlp"),
    "sequential": ("input_layernorm", "post_attention_layernorm"),
}


def _num_kv_heads(cfg: dict) -> int:
    """K, as HF's FalconAttention has it; ValueError where its reshapes would fail."""
    num_heads = cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_kv_heads") or num_heads
    if cfg["new_decoder_architecture"]:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} must be a multiple of num_kv_heads="
                f"{num_kv_heads} with new_decoder_architecture"
            )
        return num_kv_heads
    if cfg["multi_query"]:
        return 1
    if num_kv_heads != num_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} is not supported without multi_query or "
            f"new_decoder_architecture; allowed: num_attention_heads ({num_heads})"
        )
    return num_heads


def _residual(cfg: dict) -> str:
    """The layer's residual (RESIDUALS) as HF's FalconDecoderLayer builds and runs its norms;
    ValueError for the settings under which HF's layer fails."""
    num_norms = cfg.get("num_ln_in_parallel_attn")
    if num_norms not in (None, 1, 2):
        raise ValueError(f"num_ln_in_parallel_attn must be null, 1 or 2, got {num_norms!r}")
    if not cfg["parallel_attn"]:
        if cfg["new_decoder_architecture"]:
            raise ValueError(
                "parallel_attn=False is not supported with new_decoder_architecture (HF's layer "
                "fails); allowed: parallel_attn=True"
            )
        return "sequential"
    if not cfg["new_decoder_architecture"]:
        if num_norms == 2:
            raise ValueError(
                "num_ln_in_parallel_attn=2 is not supported without new_decoder_architecture "
                "(HF's layer fails); allowed: null or 1"
            )
        return "parallel_shared_norm"
    return "parallel_shared_norm" if num_norms == 1 else "parallel"


def _qkv_blocks(x: np.ndarray, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """query_key_value's rows [K * (G + 2) * H, ...] (per KV group: G queries, its key, its
    value) -> [(N + 2K) * H, ...] in q|k|v blocks, the query heads in order; a weight [., D]
    or a bias [.]."""
    rest = x.shape[1:]
    groups = x.reshape(num_kv_heads, -1, head_dim, *rest)  # [K, G + 2, H, ...]
    q = groups[:, :-2].reshape(-1, *rest)  # [N * H, ...], head k * G + g
    k = groups[:, -2].reshape(-1, *rest)  # [K * H, ...]
    v = groups[:, -1].reshape(-1, *rest)  # [K * H, ...]
    return np.concatenate([q, k, v])


class FalconForCausalLM(LayerNormRotaryForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        if cfg.get("n_embed") is not None:  # FalconConfig's old name, which wins
            cfg["hidden_size"] = cfg["n_embed"]
        if cfg["alibi"]:
            raise ValueError(
                "alibi=True (ALiBi position biases, Falcon-RW) is not supported; allowed: "
                "False (rotary embeddings)"
            )
        bias = bool(cfg["bias"])
        residual = _residual(cfg)
        cfg.update(
            num_key_value_heads=_num_kv_heads(cfg),
            head_dim=whole_head_dim(cfg),
            intermediate_size=cfg.get("ffn_hidden_size") or 4 * cfg["hidden_size"],
            hidden_act=cfg["activation"],
            attention_bias=bias,
            sliding_window=None,
        )
        options = decoder_options(residual=residual, mlp_bias=bias, o_proj_bias=bias)
        return layer_norm_rotary_config(cfg, eps_key="layer_norm_epsilon", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors (under "transformer.") into this module's params."""
        bias = config.attention_bias
        attn_norm, mlp_norm = _NORMS[config.option("residual")]
        qkv_blocks = functools.partial(
            _qkv_blocks, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim
        )
        weights.set_layer_prefix("transformer.h.{}.")
        weights.tensor("embed.embedding", "transformer.word_embeddings.weight")
        cls.load_layer_norm(weights, "layers.attn_norm", attn_norm)
        qkv = ("self_attention.query_key_value",)
        cls.load_linear(weights, "layers.attn.qkv", qkv, bias, transform=qkv_blocks)
        cls.load_linear(weights, "layers.attn.o", ("self_attention.dense",), bias)
        if mlp_norm is not None:
            cls.load_layer_norm(weights, "layers.mlp_norm", mlp_norm)
        cls.load_linear(weights, "layers.mlp.up", ("mlp.dense_h_to_4h",), bias)
        cls.load_linear(weights, "layers.mlp.down", ("mlp.dense_4h_to_h",), bias)
        cls.load_head(config, weights, "transformer.ln_f")
