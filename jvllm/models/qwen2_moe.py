"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases, no qk-norm) and a sparse MoE MLP with a gated shared expert (layers/moe.py).

As HF's Qwen2MoeConfig reads its config.json:
- the router's top-k weights are renormalised only with `norm_topk_prob` (default False);
- `qkv_bias` (default True) puts the biases on q/k/v, never on o; `attention_bias` is not read;
- with `use_sliding_window` and no `layer_types`, the windowed layers are the even ones below
  `max_window_layers` (Qwen2's are those from it on); without it no layer is windowed.
Layers with a dense MLP (`decoder_sparse_step` > 1, `mlp_only_layers`) run as a stack of their
own where they come before the sparse ones, as Qwen3-MoE's (qwen3_moe.set_dense_prefix); any
other mix, and a model without experts, is refused.
"""

from jvllm.config import ModelConfig
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.qwen3_moe import Qwen3MoeForCausalLM, set_dense_prefix
from jvllm.models.weights import CheckpointWeights

# Qwen2MoeConfig's defaults, where a config.json does not say.
_DEFAULTS = {
    "num_key_value_heads": 16,
    "max_position_embeddings": 32768,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "max_window_layers": 28,
    "sliding_window": 4096,
}


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        attention_bias = bool(cfg.pop("qkv_bias", True))
        cfg.pop("attention_bias", None)  # not Qwen2-MoE's field: HF ignores it
        cfg = LlamaForCausalLM.normalize_hf_config(cfg)
        cfg["attention_bias"] = attention_bias
        cfg = set_dense_prefix(cfg)
        if not cfg.get("use_sliding_window"):
            cfg["sliding_window"] = None
        elif not cfg.get("layer_types"):
            end = cfg["max_window_layers"]
            cfg["layer_types"] = [
                "sliding_attention" if i % 2 == 0 and i < end else "full_attention"
                for i in range(cfg["num_hidden_layers"])
            ]
        return cfg

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        Qwen3MoeForCausalLM.load_mlp_weights(config, weights)  # the same router and experts
        if not config.shared_expert_intermediate_size:
            return
        shared = "mlp.shared_expert."
        weights.stacked(
            "layers.mlp.shared_expert.gate_up.weight",
            (shared + "gate_proj.weight", shared + "up_proj.weight"),
        )
        weights.stacked("layers.mlp.shared_expert.down.weight", (shared + "down_proj.weight",))
        weights.stacked(
            "layers.mlp.shared_gate",
            ("mlp.shared_expert_gate.weight",),
            transform=lambda w: w.reshape(-1),  # [1, D] -> [D]
        )
