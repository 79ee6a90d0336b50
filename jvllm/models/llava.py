"""LLaVA-1.5 (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer MLP projector,
and a Llama-family language model that reads the projected patches in place of the prompt's
image tokens.

The step is the text model's: the runner encodes each image once (`encode_images`, its own
executable; worker/encoder_runner.py), and the step's `mm` carries the embeddings of the image
tokens it computes, which replace those tokens' embeddings before the first layer, as HF's
`masked_scatter` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import transformers

from jvllm.config import ModelConfig
from jvllm.layers.linear import Linear
from jvllm.models.clip_vision import CLIPVisionTower
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.vit import vision_settings
from jvllm.models.weights import CheckpointWeights

# The text models a LLaVA checkpoint may hold, by text_config.model_type.
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_PROJECTOR_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}
_SELECT_STRATEGIES = ("default", "full")
# What CLIPVisionConfig assumes where a vision_config says nothing.
_CLIP_DEFAULTS = lambda: transformers.CLIPVisionConfig().to_dict()


class LlavaForConditionalGeneration(LlamaForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        text = dict(cfg.get("text_config") or {})
        model_type = text.get("model_type", "llama")
        if model_type not in _TEXT_ARCHITECTURES:
            raise ValueError(
                f"text_config.model_type={model_type!r} is not supported in a LLaVA checkpoint; "
                f"allowed: {tuple(_TEXT_ARCHITECTURES)}"
            )
        text["architectures"] = [_TEXT_ARCHITECTURES[model_type]]
        text = LlamaForCausalLM.normalize_hf_config(text)
        text["architectures"] = ["LlavaForConditionalGeneration"]
        for name in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if cfg.get(name) is not None:
                text[name] = cfg[name]
        act = cfg.get("projector_hidden_act", "gelu")
        if act not in _PROJECTOR_ACTIVATIONS:
            raise ValueError(
                f"projector_hidden_act={act!r} is not supported; allowed: "
                f"{tuple(_PROJECTOR_ACTIVATIONS)}"
            )
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in _SELECT_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy={strategy!r} is not supported; allowed: "
                f"{_SELECT_STRATEGIES}"
            )
        vision_config = {**_CLIP_DEFAULTS(), **(cfg.get("vision_config") or {})}
        if vision_config["model_type"] != "clip_vision_model":
            raise ValueError(
                f"vision_config.model_type={vision_config.get('model_type')!r} is not "
                "supported in a LLaVA checkpoint; allowed: 'clip_vision_model'"
            )
        image_token_id = cfg.get("image_token_index", cfg.get("image_token_id"))
        if not isinstance(image_token_id, int):
            raise TypeError(f"image_token_index must be an int, got {image_token_id!r}")
        text["options"] = {
            **text.get("options", {}),
            "vision": vision_settings(vision_config, cfg.get("vision_feature_layer", -2)),
            "image_token_id": image_token_id,
            "projector_act": act,
            "projector_bias": bool(cfg.get("multimodal_projector_bias", True)),
            "keep_class_token": strategy == "full",
        }
        return text

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        dtype = jnp.dtype(config.dtype)
        vision = config.option("vision")
        bias = config.option("projector_bias")
        d = config.hidden_size
        self.vision = CLIPVisionTower(vision, dtype)
        self.projector_in = Linear(
            vision.hidden_size, d, ("embed", "embed"), dtype=dtype, bias=bias
        )
        self.projector_out = Linear(d, d, ("embed", "embed"), dtype=dtype, bias=bias)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values f32[N, 3, S, S] -> each image's embeddings f32[N, I, D] (I: the image's
        tokens in the prompt, `image_num_embeds`)."""
        features = self.vision(pixel_values)  # [N, Q, C]
        if not self.config.option("keep_class_token"):
            features = features[:, 1:]
        act = _PROJECTOR_ACTIVATIONS[self.config.option("projector_act")]
        return self.projector_out(act(self.projector_in(features)))

    @staticmethod
    def image_num_embeds(config: ModelConfig) -> int:
        """The embeddings (and prompt tokens) of every image: one a patch, plus the class
        token's under the "full" strategy."""
        return config.option("vision").num_patches + config.option("keep_class_token")

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        text, lm_head, outer = checkpoint_layout(weights)
        vision = outer + "vision_tower."
        if weights.has(vision + "vision_model.pre_layrnorm.weight"):
            vision += "vision_model."
        num_vision_layers = config.option("vision").num_layers
        CLIPVisionTower.load_weights(weights, "vision", vision, num_vision_layers)
        load_projector(weights, outer + "multi_modal_projector.", config.option("projector_bias"))
        weights.set_layers(0, config.num_layers)
        super().load_weights(config, weights, prefix=text, lm_head=lm_head)


def checkpoint_layout(weights: CheckpointWeights) -> tuple[str, str, str]:
    """(the text model's prefix, the LM head's name, the vision tower's and projector's prefix)
    of a LLaVA-shaped checkpoint (LLaVA, Mistral 3): saved by transformers 4 (and by 5, which
    converts back on save) under "language_model.model."; transformers 5's own modules name them
    "model.language_model."."""
    if weights.has("language_model.model.norm.weight"):
        return "language_model.model.", "language_model.lm_head.weight", ""
    return "model.language_model.", "lm_head.weight", "model."


def load_projector(weights: CheckpointWeights, prefix: str, bias: bool) -> None:
    """The projector's two linear maps (projector_in, projector_out) from HF's linear_1 and
    linear_2 under `prefix`."""
    for path, name in (("projector_in", "linear_1"), ("projector_out", "linear_2")):
        weights.tensor(f"{path}.weight", f"{prefix}{name}.weight")
        if bias:
            weights.tensor(f"{path}.bias", f"{prefix}{name}.bias")
