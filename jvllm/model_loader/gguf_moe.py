"""llama.cpp's MoE files read back as HF's: the expert and shared-expert tensor names
(gguf.py splits each layer's 3-D expert tensor into per-expert ones under these names), and the
expert metadata of `qwen3moe`, `qwen2moe` and Mixtral (a `llama` with experts) into the HF
config dict. gguf_arch.py holds the architectures that use them."""

from __future__ import annotations

from typing import Any

from jvllm.model_loader.gguf_file import GGUFFile

# Qwen2-MoE's shared expert and its gate.
SHARED_EXPERT = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# A layer's experts: llama.cpp's 3-D tensor [E, out, in] -> HF's name of expert j's [out, in].
QWEN_EXPERTS = {
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
}
MIXTRAL_EXPERTS = {
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{}.w2.weight",
}
_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func for softmax over the router's logits


def read_qwen_moe(gguf: GGUFFile, arch: str, cfg: dict[str, Any]) -> None:
    """Qwen3-MoE and Qwen2-MoE: experts in every layer (llama.cpp's graphs have no dense
    layers), each expert_feed_forward_length wide (llama.cpp's default: feed_forward_length /
    expert_used_count). llama.cpp renormalises the top-k weights for qwen3moe and never for
    qwen2moe, whatever the HF config said, so norm_topk_prob follows the architecture.
    Qwen2-MoE's shared expert is expert_shared_feed_forward_length wide (default:
    feed_forward_length), and its q/k/v biases are there when the file holds them."""
    meta = gguf.metadata.get
    cfg["num_experts"], cfg["num_experts_per_tok"] = read_experts(gguf, arch)
    default_width = cfg["intermediate_size"] // cfg["num_experts_per_tok"]
    cfg["moe_intermediate_size"] = meta(f"{arch}.expert_feed_forward_length") or default_width
    cfg["norm_topk_prob"] = arch == "qwen3moe"
    if arch == "qwen2moe":
        shared_width = meta(f"{arch}.expert_shared_feed_forward_length")
        cfg["shared_expert_intermediate_size"] = shared_width or cfg["intermediate_size"]
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in gguf.tensors


def read_experts(gguf: GGUFFile, arch: str) -> tuple[int, int]:
    """(expert_count, expert_used_count), refusing routing that HF's softmax-then-top-k router
    does not do: another gating function, or the weights scaled."""
    meta = gguf.metadata.get
    num_experts, top_k = meta(f"{arch}.expert_count"), meta(f"{arch}.expert_used_count")
    if not num_experts or not top_k:
        raise ValueError(
            f"GGUF {arch}.expert_count={num_experts!r} and {arch}.expert_used_count={top_k!r} "
            "are not supported; supported: positive counts (a MoE file gives both)"
        )
    gating = meta(f"{arch}.expert_gating_func", _SOFTMAX_GATING)
    scale = meta(f"{arch}.expert_weights_scale", 0.0)
    if gating != _SOFTMAX_GATING or scale not in (0.0, 1.0):
        raise ValueError(
            f"GGUF {arch}.expert_gating_func={gating} and {arch}.expert_weights_scale={scale} "
            f"are not supported; supported: {_SOFTMAX_GATING} (softmax) and 0 or 1 (unscaled)"
        )
    return num_experts, top_k
