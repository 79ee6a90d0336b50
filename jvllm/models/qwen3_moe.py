"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k RMSNorm) and a sparse MoE MLP.

The router's top-k weights are renormalised to sum 1 only when the config sets
`norm_topk_prob`. Layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1) are
run as a stack of their own before the MoE layers where they come first (`set_dense_prefix`);
any other mix is refused: the layer scan runs one kind of layer a stack, and the released
Qwen3-MoE models are sparse in every layer.
"""

from jvllm.config import ModelConfig
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = LlamaForCausalLM.normalize_hf_config(cfg)
        cfg["qk_norm"] = True
        # Qwen3MoeConfig's defaults; transformers 5 saves the expert count as num_local_experts.
        cfg.setdefault("num_key_value_heads", 4)
        cfg.setdefault("num_experts", cfg.get("num_local_experts", 128))
        cfg.setdefault("num_experts_per_tok", 8)
        cfg.setdefault("norm_topk_prob", False)
        return set_dense_prefix(cfg)

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


def set_dense_prefix(cfg: dict) -> dict:
    """HF's Qwen2-MoE / Qwen3-MoE rule: layer i is sparse when num_experts > 0, i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else a dense MLP of
    intermediate_size. Dense layers 0 .. k-1 before sparse ones become the option
    num_dense_layers k (LlamaForCausalLM runs them as a stack of their own); any other mix is
    a ValueError."""
    step, mlp_only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive int, got {step!r}")
    num_layers = cfg["num_hidden_layers"]
    dense = [
        i for i in range(num_layers) if not cfg["num_experts"] or i in mlp_only or (i + 1) % step
    ]
    if dense != list(range(len(dense))) or len(dense) == num_layers:
        raise ValueError(
            f"decoder_sparse_step={step}, mlp_only_layers={mlp_only} and "
            f"num_experts={cfg['num_experts']} make layers {dense} dense MLPs (of "
            f"{num_layers}), which is not supported; allowed: dense layers only before the "
            "sparse ones (e.g. mlp_only_layers [0, 1] with decoder_sparse_step 1), and at least "
            "one sparse layer"
        )
    if dense:
        cfg["options"] = {**cfg.get("options", {}), "num_dense_layers": len(dense)}
    return cfg
