"""StableLM (StableLmForCausalLM: StableLM-3B-4E1T, StableLM 2) as flax.nnx modules, on the
LayerNorm rotary layers (models/layer_norm_rotary.py), read as HF's modeling_stablelm.py runs it:
- LayerNorms, sequential by default; with `use_parallel_residual`, one LayerNorm feeding both:
  x + attn(ln(x)) + mlp(ln(x));
- rotary embeddings over the first `partial_rotary_factor` (default 0.25) of each head;
- q/k/v biased where `use_qkv_bias`, the output projection never;
- with `qk_layernorm`, a LayerNorm over H without bias for each head of q and of k, each head
  with its own weight (StableLM 2 12B's);
- Llama's gated MLP without biases, a final LayerNorm, an LM head of its own unless tied.
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
from jvllm.rope_config import ROTARY_FRACTION_KEY, hf_partial_rotary_factor

# What StableLmConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
_PARTIAL_ROTARY_FACTOR = 0.25


class StableLmForCausalLM(LayerNormRotaryForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        cfg[ROTARY_FRACTION_KEY] = hf_partial_rotary_factor(cfg, _PARTIAL_ROTARY_FACTOR)
        cfg.update(
            head_dim=whole_head_dim(cfg),
            attention_bias=bool(cfg.get("use_qkv_bias")),
            sliding_window=None,
        )
        residual = "parallel_shared_norm" if cfg.get("use_parallel_residual") else "sequential"
        options = decoder_options(
            residual=residual,
            mlp_bias=False,
            o_proj_bias=False,
            qk_layernorm="per_head" if cfg.get("qk_layernorm") else None,
            is_gated_mlp=True,
        )
        return layer_norm_rotary_config(cfg, eps_key="layer_norm_eps", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params."""
        cls.load_model_prefixed_input(weights, config.attention_bias)
        if config.option("qk_layernorm"):
            for path, name, num_heads in (
                ("q_norm", "q_layernorm", config.num_heads),
                ("k_norm", "k_layernorm", config.num_kv_heads),
            ):
                heads = tuple(f"self_attn.{name}.norms.{j}.weight" for j in range(num_heads))
                weights.stacked(f"layers.attn.{path}.weight", heads)
        cls.load_linear(weights, "layers.attn.o", ("self_attn.o_proj",), False)
        if config.option("residual") == "sequential":
            cls.load_layer_norm(weights, "layers.mlp_norm", "post_attention_layernorm")
        weights.stacked("layers.mlp.gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        weights.stacked("layers.mlp.down.weight", ("mlp.down_proj.weight",))
        cls.load_head(config, weights, "model.norm")
