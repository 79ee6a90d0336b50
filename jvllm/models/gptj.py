"""GPT-J (GPTJForCausalLM: GPT-J-6B and its fine-tunes) as flax.nnx modules, on the LayerNorm
rotary layers (models/layer_norm_rotary.py), read as HF's modeling_gptj.py runs it:
- one LayerNorm (with bias) feeding attention and the MLP in parallel:
  x + attn(ln_1(x)) + mlp(ln_1(x));
- rotary embeddings over the first `rotary_dim` dims of each head, interleaved (GPT-J's
  rotate_every_two: dims 2i, 2i + 1 pair up; layers/rotary.py), base 10000 always (HF's
  sinusoid table has no other);
- q, k, v and the output projection without biases; fc_in / fc_out with biases around
  `activation_function` (gelu_new);
- a final LayerNorm and an LM head with a bias (its weight tied to the embedding only where
  the config ties it).
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.layer_norm_rotary_decoder import decoder_options
from jvllm.models.layer_norm_rotary import (
    LayerNormRotaryForCausalLM,
    layer_norm_rotary_config,
    whole_head_dim,
)
from jvllm.models.weights import CheckpointWeights
from jvllm.rope_config import ROTARY_FRACTION_KEY

# What GPTJConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "vocab_size": 50400,
    "n_positions": 2048,
    "n_embd": 4096,
    "n_layer": 28,
    "n_head": 16,
    "rotary_dim": 64,
    "activation_function": "gelu_new",
    "tie_word_embeddings": False,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}
# GPTJConfig's attribute_map: the Llama names ModelConfig reads -> GPT-J's own.
_NAMES = {
    "max_position_embeddings": "n_positions",
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}
_ROPE_THETA = 10000.0


def _rotary_fraction(rotary_dim, head_dim: int) -> float:
    """rotary_dim as the fraction of a head ModelConfig reads; ValueError for what HF's GPT-J
    cannot run (None rotates a hidden_size-wide table over each head) or no pair rotates."""
    if not isinstance(rotary_dim, int) or not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim={rotary_dim!r} is not supported; allowed: an even int in [2, "
            f"head_dim={head_dim}]"
        )
    fraction = rotary_dim / head_dim
    if int(head_dim * fraction) != rotary_dim:  # a fraction that does not round-trip
        raise ValueError(f"rotary_dim={rotary_dim} of head_dim={head_dim} is not supported")
    return fraction


class GPTJForCausalLM(LayerNormRotaryForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        for name, gptj_name in _NAMES.items():
            cfg[name] = cfg.get(gptj_name, cfg.get(name))
        head_dim = whole_head_dim(cfg)
        cfg.update(
            intermediate_size=cfg.get("n_inner") or 4 * cfg["hidden_size"],
            num_key_value_heads=cfg["num_attention_heads"],
            head_dim=head_dim,
            hidden_act=cfg["activation_function"],
            rope_theta=_ROPE_THETA,
            rope_parameters=None,  # HF's GPT-J reads no rope settings
            rope_scaling=None,
            attention_bias=False,
            sliding_window=None,
            is_rope_interleaved=True,
        )
        cfg[ROTARY_FRACTION_KEY] = _rotary_fraction(cfg["rotary_dim"], head_dim)
        options = decoder_options(
            residual="parallel_shared_norm",
            mlp_bias=True,
            o_proj_bias=False,
            lm_head_bias=True,
        )
        return layer_norm_rotary_config(cfg, eps_key="layer_norm_epsilon", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors (under "transformer.") into this module's params."""
        weights.set_layer_prefix("transformer.h.{}.")
        weights.tensor("embed.embedding", "transformer.wte.weight")
        cls.load_layer_norm(weights, "layers.attn_norm", "ln_1")
        qkv = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
        cls.load_linear(weights, "layers.attn.qkv", qkv, False)
        cls.load_linear(weights, "layers.attn.o", ("attn.out_proj",), False)
        cls.load_linear(weights, "layers.mlp.up", ("mlp.fc_in",), True)
        cls.load_linear(weights, "layers.mlp.down", ("mlp.fc_out",), True)
        cls.load_head(config, weights, "transformer.ln_f")
