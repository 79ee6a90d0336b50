"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k RMSNorm) and a sparse MoE MLP.

The router's top-k weights are renormalised to sum 1 only when the config sets
`norm_topk_prob`. Checkpoints whose layers mix dense and sparse MLPs (`decoder_sparse_step` >
1 or `mlp_only_layers`) are refused: the layer scan runs one kind of layer, and the released
Qwen3-MoE models are sparse in every layer.
"""

from jvllm.config import ModelConfig
from jvllm.model_loader.weights import CheckpointWeights
from jvllm.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = LlamaForCausalLM.normalize_hf_config(cfg)
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise ValueError(
                "decoder_sparse_step != 1 and mlp_only_layers (dense MLPs in some layers) are "
                f"not supported, got {cfg.get('decoder_sparse_step')} and "
                f"{cfg.get('mlp_only_layers')}; allowed: every layer sparse (1 and [])"
            )
        cfg["qk_norm"] = True
        cfg.setdefault("num_experts", 128)  # Qwen3MoeConfig's defaults
        cfg.setdefault("num_experts_per_tok", 8)
        cfg.setdefault("norm_topk_prob", False)
        return cfg

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        weights.stacked("layers.mlp.router", ("mlp.gate.weight",))
        experts = "mlp.experts.{}."
        weights.stacked_experts(
            "layers.mlp.gate_up",
            (experts + "gate_proj.weight", experts + "up_proj.weight"),
            config.num_experts,
        )
        weights.stacked_experts(
            "layers.mlp.down", (experts + "down_proj.weight",), config.num_experts
        )
