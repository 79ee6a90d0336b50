"""GLM-4.5's multi-token-prediction (MTP) layer as a draft head (speculative decoding's "mtp"
method; vLLM's Glm4MoeMTPModel), read from the target's own checkpoint.

The checkpoints (GLM-4.5, GLM-4.5-Air, GLM-4.6) keep it as DeepSeek-V3's keep theirs, after the
target's L layers under model.layers.{L}.: enorm, hnorm, eh_proj, a decoder layer as the
target's MoE layers (models/glm4_moe.py) and shared_head.norm / shared_head.head; it drafts as
DeepSeek-V3's does (models/deepseek_mtp.py, which runs it).
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.models.deepseek_mtp import DeepseekMTPHead
from jvllm.models.glm4_moe import Glm4MoeDecoderLayer, Glm4MoeForCausalLM
from jvllm.models.weights import CheckpointWeights


class Glm4MoeMTPHead(DeepseekMTPHead):
    target_architecture = "Glm4MoeForCausalLM"
    target_model_types = ("glm4_moe",)
    decoder_layer = Glm4MoeDecoderLayer

    @staticmethod
    def rotary_config(config: ModelConfig) -> ModelConfig:
        return config  # the target's: rotary on the first partial_rotary_factor of each head

    @staticmethod
    def load_layer(config: ModelConfig, weights: CheckpointWeights, is_moe: bool) -> None:
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        Glm4MoeForCausalLM.load_layer_weights(config, weights, attn)
        Glm4MoeForCausalLM.load_mlp_weights(config, weights)
