"""Granite 4.0 (GraniteMoeHybridForCausalLM) where every layer is attention: Granite-4.0-Micro,
granite-4.0-1b and -350m, as HF's modeling_granitemoehybrid.py runs them: GraniteMoeShared's
blocks (models/granitemoe.py: Granite's four scalings, the experts beside an ungated shared
MLP), or with num_local_experts 0 the shared MLP alone; rotary embeddings only where
position_embedding_type is "rope" (else no layer rotates).

The Granite 4.0 H models' Mamba 2 layers ("mamba" / "linear_attention" in layer_types) keep a
recurrent state per request that jvllm's paged KV cache does not hold: such a config is refused,
naming its layers.
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.models.granitemoe import GraniteMoeForCausalLM
from jvllm.models.weights import CheckpointWeights

_POSITION_EMBEDDINGS = ("rope", "nope", None)
# An attention layer's names: the released configs' and transformers 5's.
_ATTENTION = ("attention", "full_attention")


def _normalize(cfg: dict) -> dict:
    num_layers = cfg["num_hidden_layers"]
    # Without either list HF's config makes every layer Mamba 2.
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    recurrent = [i for i, kind in enumerate(kinds) if kind not in _ATTENTION]
    if recurrent:
        raise ValueError(
            f"layers {recurrent} of this GraniteMoeHybridForCausalLM are {kinds[recurrent[0]]!r} "
            "(Mamba 2) layers, which are not supported yet; allowed: configs whose layer_types "
            f"are all {_ATTENTION} (Granite-4.0-Micro, granite-4.0-1b, granite-4.0-350m)"
        )
    position = cfg.get("position_embedding_type")
    if position not in _POSITION_EMBEDDINGS:
        raise ValueError(
            f"position_embedding_type={position!r} is not supported; allowed: "
            f"{_POSITION_EMBEDDINGS}"
        )
    # GraniteMoeHybridConfig's defaults.
    num_experts = cfg.get("num_local_experts", 8)
    cfg = {"shared_intermediate_size": 1024, **cfg}
    shared = {k: v for k, v in cfg.items() if k not in ("layer_types", "layers_block_type")}
    shared["architectures"] = ["GraniteMoeSharedForCausalLM"]
    cfg = GraniteMoeForCausalLM.normalize_hf_config({**shared, "num_local_experts": num_experts})
    if not num_experts:  # a dense block: the shared MLP alone
        cfg["intermediate_size"] = cfg["shared_expert_intermediate_size"]
        cfg.update(num_experts=0, num_local_experts=0, shared_expert_intermediate_size=0)
    if position != "rope":
        cfg["options"] = {**cfg.get("options", {}), "rope_layers": (False,) * num_layers}
    cfg["architectures"] = ["GraniteMoeHybridForCausalLM"]
    return cfg


class GraniteMoeHybridForCausalLM(GraniteMoeForCausalLM):
    normalize_hf_config = staticmethod(_normalize)

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        if config.num_experts:
            GraniteMoeForCausalLM.load_mlp_weights(config, weights)
            return
        weights.stacked("layers.mlp.gate_up.weight", ("shared_mlp.input_linear.weight",))
        weights.stacked("layers.mlp.down.weight", ("shared_mlp.output_linear.weight",))
