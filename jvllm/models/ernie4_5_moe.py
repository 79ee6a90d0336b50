"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B) on Llama's
modules, read as HF's modeling_ernie4_5_moe.py runs it: the dense ERNIE 4.5's attention
(models/ernie4_5.py: interleaved rotary over the whole head), dense gated MLPs in the layers
before `moe_layer_start_index`, and in the others a mixture of experts (layers/deepseek_moe.py)
routed by softmax with a correction bias (`moe_statics`), the top `moe_k` of
`moe_num_experts` renormalised, beside `moe_num_shared_experts` always-on shared experts.

The layer scan runs one kind of layer a stack, so the MoE layers must run to the last layer
every `moe_layer_interval` 1, as the released checkpoints do; other layouts are refused. The
multi-token-prediction layers the checkpoints keep (under "mtp" names) are not part of the
model (HF skips them too; vLLM drafts with them as "ernie_mtp", which jvllm does not yet).
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.deepseek_moe import ERNIE_NORM_MIN
from jvllm.models.ernie4_5 import Ernie4_5ForCausalLM
from jvllm.models.glm4_moe import Glm4MoeDecoderLayer, load_moe_weights
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights

# What Ernie4_5_MoeConfig assumes where a config.json says nothing (the rest as the dense one).
_DEFAULTS = {
    "num_key_value_heads": 4,
    "head_dim": None,  # HF's attention takes hidden_size / heads
    "moe_intermediate_size": 1536,
    "moe_k": 6,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": -1,
    "moe_layer_interval": 1,
    "moe_norm_min": ERNIE_NORM_MIN,
}


def _check_layout(cfg: dict) -> int:
    """The number of dense layers before the MoE ones; a ValueError for a layout the layer
    scan cannot run (MoE layers that are not every layer from the first one to the last)."""
    num_layers = cfg["num_hidden_layers"]
    start, end = cfg["moe_layer_start_index"], cfg["moe_layer_end_index"]
    interval = cfg["moe_layer_interval"]
    fields = {"moe_layer_start_index": start, "moe_layer_end_index": end}
    for name, value in {**fields, "moe_layer_interval": interval}.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    end = num_layers - 1 if end == -1 else end
    if interval != 1 or end != num_layers - 1 or not 0 <= start < num_layers:
        raise ValueError(
            f"moe_layer_start_index={start}, moe_layer_end_index={end} and "
            f"moe_layer_interval={interval} are not supported for {num_layers} layers; "
            "allowed: MoE layers from a start index to the last layer, interval 1 (as the "
            "released ERNIE 4.5 MoE checkpoints)"
        )
    return start


def _normalize(cfg: dict) -> dict:
    cfg = {**_DEFAULTS, **cfg}
    if cfg.get("use_bias"):
        raise ValueError(
            "use_bias=True is not supported for Ernie4_5_MoeForCausalLM; allowed: False (HF's "
            "experts have no biases beside the other projections', and no released checkpoint "
            "sets it)"
        )
    if cfg["moe_norm_min"] != _DEFAULTS["moe_norm_min"]:
        raise ValueError(
            f"moe_norm_min={cfg['moe_norm_min']} is not supported; allowed: {ERNIE_NORM_MIN}"
        )
    num_dense = _check_layout(cfg)
    top_k, num_experts = cfg["moe_k"], cfg["moe_num_experts"]
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"moe_num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        raise ValueError(f"moe_k must be in [1, moe_num_experts={num_experts}], got {top_k!r}")
    cfg["num_experts"] = cfg["num_local_experts"] = num_experts
    cfg["num_experts_per_tok"] = top_k
    cfg["norm_topk_prob"] = True
    num_shared = cfg["moe_num_shared_experts"] or 0
    cfg["shared_expert_intermediate_size"] = num_shared * cfg["moe_intermediate_size"]
    options = {"routing": "softmax_biased"}
    if num_dense:  # LlamaForCausalLM runs them as a stack of their own, first
        options["num_dense_layers"] = num_dense
    cfg["options"] = {**cfg.get("options", {}), **options}
    return Ernie4_5ForCausalLM.normalize_hf_config(cfg)


class Ernie4_5_MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = Glm4MoeDecoderLayer  # the same block: Llama's, with DeepSeek's experts
    normalize_hf_config = staticmethod(_normalize)

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        """The MoE layers' router, correction bias ([1, E] in the checkpoint), routed and
        shared experts."""
        load_moe_weights(config, weights, "mlp.moe_statics.e_score_correction_bias")
