"""The one model registry: HF `architectures` name -> the module class that runs it.

Modules are imported on first use, so that reading a config (and this list) imports no model.
"""

import importlib

# architecture -> (module under jvllm.models, class)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Ministral3ForCausalLM": ("ministral3", "Ministral3ForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTBigCodeForCausalLM": ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "Phi3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "GraniteForCausalLM": ("llama", "LlamaForCausalLM"),
    "SmolLM3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "SeedOssForCausalLM": ("seed_oss", "SeedOssForCausalLM"),
    "ArceeForCausalLM": ("arcee", "ArceeForCausalLM"),
    "ApertusForCausalLM": ("apertus", "ApertusForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("hunyuan", "HunYuanDenseV1ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "NemotronForCausalLM": ("nemotron", "NemotronForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("cohere", "CohereForCausalLM"),
    "GlmForCausalLM": ("glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("glm", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "Dots1ForCausalLM": ("dots1", "Dots1ForCausalLM"),
    "GPTJForCausalLM": ("gptj", "GPTJForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": ("granitemoe", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granitemoe", "GraniteMoeForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "FalconForCausalLM": ("falcon", "FalconForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("llava_next", "LlavaNextForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)
# Draft heads: speculative_config's `model` for a method that drafts from the target's hidden
# states, never an engine's own model (they take the target's rows, not tokens alone).
_DRAFT_HEADS = {
    "LlamaForCausalLMEagle3": ("eagle3", "Eagle3Head"),
    "Eagle3LlamaForCausalLM": ("eagle3", "Eagle3Head"),
    "DeepSeekMTPModel": ("deepseek_mtp", "DeepseekMTPHead"),  # vLLM's name
    "Glm4MoeMTPModel": ("glm4_moe_mtp", "Glm4MoeMTPHead"),  # vLLM's name
    "EagleLlamaForCausalLM": ("eagle1", "EagleHead"),  # vLLM's name for method "eagle"
}
# The speculative_config method each draft head's module serves.
_HEAD_METHODS = {
    "eagle3": "eagle3",
    "deepseek_mtp": "mtp",
    "glm4_moe_mtp": "mtp",
    "eagle1": "eagle",
}
# Speculative decoding's "eagle" method: the head its checkpoints load as (they name
# themselves LlamaForCausalLM).
EAGLE_HEAD_ARCHITECTURE = "EagleLlamaForCausalLM"
# Speculative decoding's "mtp" method: a target architecture -> the head that reads the
# multi-token-prediction layers its checkpoints keep.
_MTP_HEADS = {
    "DeepseekV3ForCausalLM": "DeepSeekMTPModel",
    "Glm4MoeForCausalLM": "Glm4MoeMTPModel",
}
# HF's base models (no LM head), as embedding checkpoints ship them (Qwen3-Embedding,
# e5-mistral): each runs as its causal LM's family, whose tensor names lose their first
# component in such a checkpoint (model_loader/base_model.py). Not Phi's or GPT-J's (their LM
# head has a bias, which a headless load does not drop) nor those not checked against HF.
BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Ministral3Model": "Ministral3ForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Phi3Model": "Phi3ForCausalLM",
    "GraniteModel": "GraniteForCausalLM",
    "SmolLM3Model": "SmolLM3ForCausalLM",
    "SeedOssModel": "SeedOssForCausalLM",
    "ArceeModel": "ArceeForCausalLM",
    "ApertusModel": "ApertusForCausalLM",
    "HunYuanDenseV1Model": "HunYuanDenseV1ForCausalLM",
    "Olmo2Model": "Olmo2ForCausalLM",
    "Olmo3Model": "Olmo3ForCausalLM",
    "Exaone4Model": "Exaone4ForCausalLM",
    "Ernie4_5Model": "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeModel": "Ernie4_5_MoeForCausalLM",
    "MixtralModel": "MixtralForCausalLM",
    "Qwen2MoeModel": "Qwen2MoeForCausalLM",
    "Qwen3MoeModel": "Qwen3MoeForCausalLM",
    "GemmaModel": "GemmaForCausalLM",
    "Gemma2Model": "Gemma2ForCausalLM",
    "GPTNeoXModel": "GPTNeoXForCausalLM",
    "Starcoder2Model": "Starcoder2ForCausalLM",
    "StableLmModel": "StableLmForCausalLM",
    "CohereModel": "CohereForCausalLM",
    "Cohere2Model": "Cohere2ForCausalLM",
    "GlmModel": "GlmForCausalLM",
    "Glm4Model": "Glm4ForCausalLM",
    "Glm4MoeModel": "Glm4MoeForCausalLM",
    "Dots1Model": "Dots1ForCausalLM",
    "OlmoeModel": "OlmoeForCausalLM",
    "GraniteMoeModel": "GraniteMoeForCausalLM",
    "GraniteMoeSharedModel": "GraniteMoeSharedForCausalLM",
    "GraniteMoeHybridModel": "GraniteMoeHybridForCausalLM",
    "FalconModel": "FalconForCausalLM",
    "Gemma3TextModel": "Gemma3ForCausalLM",
    "GPT2Model": "GPT2LMHeadModel",
    "OPTModel": "OPTForCausalLM",
}
# A config built in code (not read from a checkpoint) may have no `architectures`.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "opt": "OPTForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "arcee": "ArceeForCausalLM",
    "apertus": "ApertusForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi": "PhiForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "gptj": "GPTJForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "falcon": "FalconForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
}


def architecture_of(hf_config: dict) -> str | None:
    """The architecture an HF config.json dict names (its first; for a base model, its causal
    LM's), else its model_type's."""
    architectures = hf_config.get("architectures") or []
    if architectures:
        return BASE_MODELS.get(architectures[0], architectures[0])
    return _ARCHITECTURE_BY_MODEL_TYPE.get(hf_config.get("model_type"))


def is_draft_head(architecture: str | None) -> bool:
    return architecture in _DRAFT_HEADS


def draft_head_method(architecture: str) -> str:
    """The speculative_config method whose `model` a draft head of `architecture` is."""
    return _HEAD_METHODS[_DRAFT_HEADS[architecture][0]]


def mtp_head_architecture(target_architecture: str | None) -> str:
    """The draft head of method "mtp" for a target of `target_architecture`; a ValueError for
    a family whose checkpoints keep no MTP layers jvllm reads."""
    head = _MTP_HEADS.get(target_architecture)
    if head is None:
        raise ValueError(
            f"speculative_config method 'mtp' drafts with the multi-token-prediction layers of "
            f"the target's checkpoint; supported targets: {', '.join(_MTP_HEADS)}, got "
            f"{target_architecture}"
        )
    return head


def check_supported(architecture: str | None, model_type: str | None = None) -> None:
    if architecture not in _MODELS and architecture not in _DRAFT_HEADS:
        what = f"architecture {architecture!r}"
        if architecture is None:
            what = f"a config.json without `architectures` and with model_type {model_type!r}"
        raise ValueError(
            f"{what} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. jvllm reads the architecture from the "
            "first entry of the config.json's `architectures`, else from its model_type"
        )


def model_class(architecture: str) -> type:
    check_supported(architecture)
    module, name = _MODELS.get(architecture) or _DRAFT_HEADS[architecture]
    return getattr(importlib.import_module(f"jvllm.models.{module}"), name)
