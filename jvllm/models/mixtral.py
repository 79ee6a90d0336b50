"""Mixtral (MixtralForCausalLM): the Llama decoder with a sparse MoE MLP, every layer.

Each token's router picks its top-k experts of E and always renormalises their k weights to
sum 1; the experts run as grouped matmuls (layers/moe.py).
"""

from jvllm.config import ModelConfig
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = LlamaForCausalLM.normalize_hf_config(cfg)
        cfg.setdefault("num_key_value_heads", 8)  # MixtralConfig's defaults
        cfg.setdefault("num_local_experts", 8)
        cfg.setdefault("num_experts_per_tok", 2)
        cfg["norm_topk_prob"] = True
        return cfg

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        moe = "block_sparse_moe."
        weights.stacked("layers.mlp.router", (moe + "gate.weight",))
        experts = moe + "experts.{}."
        weights.stacked_experts(
            "layers.mlp.gate_up", (experts + "w1.weight", experts + "w3.weight"), config.num_experts
        )
        weights.stacked_experts("layers.mlp.down", (experts + "w2.weight",), config.num_experts)
