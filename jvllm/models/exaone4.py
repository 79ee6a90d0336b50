"""EXAONE 4 (Exaone4ForCausalLM) as flax.nnx modules.

OLMo 2's post-norm blocks (each block's output normed, then added to the residual stream) with
Qwen3's q/k norms, head by head (HF's modeling_exaone4.py). With a sliding window (the 32B),
three layers of four attend in their window and rotate, and the fourth attends globally without
rotary embeddings, as Cohere 2's; without one (the 1.2B) every layer attends globally and
rotates.
"""

from __future__ import annotations

from jvllm.layers.activation import check_activation
from jvllm.layers.attention import Attention
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM

# What Exaone4Config assumes where a config.json says nothing.
_DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "sliding_window": 4096,
    "num_key_value_heads": 32,
    "max_position_embeddings": 2048,
}
_SLIDING_WINDOW_PATTERN = 4  # every 4th layer global


def _normalize(cfg: dict) -> dict:
    """The config as Exaone4Config reads it: layer_types where given, else from
    `sliding_window_pattern`, every n-th layer global for an int n, or a string's letters
    repeated ("LLLG": L a windowed layer, G a global one); only the windowed layers rotate. A
    null sliding_window makes every layer global and rotating."""
    cfg = {**_DEFAULTS, **cfg}
    cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "silu"), "hidden_act")
    cfg["qk_norm"] = True
    num_layers = cfg["num_hidden_layers"]
    if cfg["sliding_window"] is None:
        cfg["layer_types"] = ["full_attention"] * num_layers
        return cfg
    if not cfg.get("layer_types"):
        pattern = cfg.get("sliding_window_pattern")
        pattern = _SLIDING_WINDOW_PATTERN if pattern is None else pattern
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            letters = [pattern[i % len(pattern)] for i in range(num_layers)]
            cfg["layer_types"] = [
                "sliding_attention" if c == "L" else "full_attention" for c in letters
            ]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            cfg["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
        else:
            raise ValueError(
                f"sliding_window_pattern must be an int > 0 or a string of 'L' (windowed) and "
                f"'G' (global) layers, got {pattern!r}"
            )
    rope_layers = tuple(t == "sliding_attention" for t in cfg["layer_types"])
    if not all(rope_layers):
        cfg["options"] = {**cfg.get("options", {}), "rope_layers": rope_layers}
    return cfg


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's post-norm block around attention with q/k norms head by head."""

    attention = Attention


class Exaone4ForCausalLM(LlamaForCausalLM):
    """Llama's embedding, layer scan (its layers without rotary embeddings), final norm and LM
    head around EXAONE 4's blocks; OLMo 2's checkpoint names."""

    decoder_layer = Exaone4DecoderLayer
    load_weights = staticmethod(Olmo2ForCausalLM.load_weights)

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        return _normalize(cfg)
