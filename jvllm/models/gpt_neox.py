"""GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B) as flax.nnx modules, on the LayerNorm
rotary layers (models/layer_norm_rotary.py), read as HF's modeling_gpt_neox.py runs it:
- `use_parallel_residual` (default True): x + attn(ln1(x)) + mlp(ln2(x)), else sequential;
- rotary embeddings over the first `rotary_pct` (default 0.25) of each head, base
  `rotary_emb_base` (transformers 5 keeps both in `rope_parameters`, whose values win);
- one fused query_key_value projection laid out head by head, [N, 3, H] rows (each head's q,
  k, v), reordered at load into q|k|v blocks; `attention_bias` (default True) on it and on the
  output projection; the MLP always biased;
- an LM head of its own ("embed_out", "lm_head" as transformers 5 saves it) unless tied.
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
from jvllm.rope_config import ROTARY_FRACTION_KEY

# What GPTNeoXConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000.0,
    "use_parallel_residual": True,
    "attention_bias": True,
    "hidden_act": "gelu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def qkv_blocks(x: np.ndarray, num_heads: int) -> np.ndarray:
    """query_key_value's rows [N * 3 * H, ...] (head by head: its q, k, v) -> [3 * N * H, ...]
    in q|k|v blocks, each block's heads in order; a weight [., D] or a bias [.]."""
    rest = x.shape[1:]
    per_head = x.reshape(num_heads, 3, -1, *rest)  # [N, 3, H, ...]
    return np.swapaxes(per_head, 0, 1).reshape(x.shape)  # [3, N, H, ...] flattened


class GPTNeoXForCausalLM(LayerNormRotaryForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        # HF's GPTNeoXConfig: the rope dict (rope_scaling, else rope_parameters) first, then
        # the old top-level names.
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        bias = bool(cfg["attention_bias"])
        cfg.update(
            num_key_value_heads=cfg["num_attention_heads"],
            head_dim=whole_head_dim(cfg),
            rope_theta=rope.get("rope_theta", cfg["rotary_emb_base"]),
            attention_bias=bias,
            sliding_window=None,
        )
        cfg[ROTARY_FRACTION_KEY] = rope.get("partial_rotary_factor", cfg["rotary_pct"])
        residual = "parallel" if cfg["use_parallel_residual"] else "sequential"
        options = decoder_options(residual=residual, mlp_bias=True, o_proj_bias=bias)
        return layer_norm_rotary_config(cfg, eps_key="layer_norm_eps", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors (under "gpt_neox.") into this module's params."""
        weights.set_layer_prefix("gpt_neox.layers.{}.")
        weights.tensor("embed.embedding", "gpt_neox.embed_in.weight")
        cls.load_layer_norm(weights, "layers.attn_norm", "input_layernorm")
        qkv_blocks_of = functools.partial(qkv_blocks, num_heads=config.num_heads)
        cls.load_linear(
            weights,
            "layers.attn.qkv",
            ("attention.query_key_value",),
            config.attention_bias,
            transform=qkv_blocks_of,
        )
        cls.load_linear(weights, "layers.attn.o", ("attention.dense",), config.attention_bias)
        cls.load_layer_norm(weights, "layers.mlp_norm", "post_attention_layernorm")
        cls.load_linear(weights, "layers.mlp.up", ("mlp.dense_h_to_4h",), True)
        cls.load_linear(weights, "layers.mlp.down", ("mlp.dense_4h_to_h",), True)
        lm_head = "embed_out" if weights.has("embed_out.weight") else "lm_head"
        cls.load_head(config, weights, "gpt_neox.final_layer_norm", lm_head)
