"""The Gemma family (Gemma, Gemma 2, Gemma 3 text) through the engine against HF transformers,
and the reading of the config layouts their checkpoints ship with."""

import numpy as np
import pytest
import torch
import transformers
from family_parity import (
    assert_hf_window_cuts,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)

from jvllm import LLM, SamplingParams
from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "attn_implementation": "eager",  # HF applies windows and soft-caps in it (Gemma 2: only)
}
WINDOW = 8  # with pages of 4, the long prompts and the prefix hit leave whole pages behind
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_gemma_with_head_dim_256_decodes_like_hf(tmp_path):
    config = transformers.GemmaConfig(**{**TINY, "head_dim": 256, "num_key_value_heads": 1})
    hf_model = save_random_model(tmp_path, config)
    assert_matches_hf(tmp_path, hf_model, PROMPTS)


LOGITS_CONFIGS = {
    # HF's GemmaConfig reads hidden_act (its "gelu" as the tanh approximation), not Gemma 2's
    # hidden_activation.
    "gemma_silu": lambda: transformers.GemmaConfig(**TINY, hidden_act="silu"),
    # Biases on q/k/v and o (no score cap: dense_logits' attention has none).
    "gemma2_biased": lambda: transformers.Gemma2Config(
        **TINY, attention_bias=True, sliding_window=WINDOW, attn_logit_softcapping=None
    ),
    "gemma3_biased": lambda: transformers.Gemma3TextConfig(
        **TINY, attention_bias=True, sliding_window=WINDOW, sliding_window_pattern=2
    ),
}


@pytest.mark.parametrize("name", list(LOGITS_CONFIGS))
def test_config_variant_logits_match_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, LOGITS_CONFIGS[name]())
    assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


def test_gemma2_window_and_soft_caps_decode_like_hf(tmp_path):
    """Alternate windowed layers, four norms a layer, query_pre_attn_scalar, and caps small
    enough to bite on these random weights. The final cap keeps the argmax, so the logprobs
    check it."""
    config = transformers.Gemma2Config(
        **{**TINY, "num_hidden_layers": 4},
        sliding_window=WINDOW,
        query_pre_attn_scalar=64,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
    )
    hf_model = save_random_model(tmp_path, config)
    assert_hf_window_cuts(hf_model, PROMPTS[-1])
    assert_matches_hf(tmp_path, hf_model, PROMPTS, block_size=4)
    _assert_prompt_logprobs_match_hf(tmp_path, hf_model, PROMPTS[-1])


def test_gemma2_on_the_pallas_kernels_decodes_like_hf(tmp_path):
    """The same through both Pallas kernels (interpret mode on CPU; their pages are >= 8)."""
    config = transformers.Gemma2Config(
        **{**TINY, "num_hidden_layers": 2},
        sliding_window=WINDOW,
        attn_logit_softcapping=3.0,
    )
    hf_model = save_random_model(tmp_path, config)
    assert_matches_hf(tmp_path, hf_model, PROMPTS, block_size=8, attention_backend="pallas")


def _assert_prompt_logprobs_match_hf(path, hf_model, prompt) -> None:
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    logprobs = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    engine = [logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], dim=-1).numpy()
    np.testing.assert_allclose(engine, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)


def _gemma3_text(num_layers: int = 6) -> dict:
    """Five windowed layers to one global; q/k norms; the global rope with its own base and a
    linear factor, the windowed layers' without."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    return {
        **TINY,
        "num_hidden_layers": num_layers,
        "head_dim": 32,
        "sliding_window": WINDOW,
        "rope_parameters": rope,
    }


def test_gemma3_local_and_global_layers_decode_like_hf(tmp_path):
    hf_model = save_random_model(tmp_path, transformers.Gemma3TextConfig(**_gemma3_text()))
    assert hf_model.config.layer_types[4:6] == ["sliding_attention", "full_attention"]
    assert_hf_window_cuts(hf_model, PROMPTS[-1])
    assert_matches_hf(tmp_path, hf_model, PROMPTS, block_size=4)


def test_gemma3_multimodal_checkpoint_runs_its_text_model_like_hf(tmp_path):
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    text = _gemma3_text(num_layers=2)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, attn_implementation="eager"
    )
    hf_model = save_random_model(tmp_path, config)
    assert type(hf_model).__name__ == "Gemma3ForConditionalGeneration"
    assert_matches_hf(tmp_path, hf_model, PROMPTS[:3], max_tokens=8, block_size=4)


# Config files as the hub's checkpoints ship them (transformers 4 layouts, defaults left out).
GEMMA_2B = {
    "architectures": ["GemmaForCausalLM"],
    "head_dim": 256,
    "hidden_act": "gelu",
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "model_type": "gemma",
    "num_attention_heads": 8,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "rope_theta": 10000.0,
    "vocab_size": 256000,
}
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "cache_implementation": "hybrid",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}
GEMMA_3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "eos_token_id": [1, 106],
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    # gemma-3-4b-it's, as its config.json gives it.
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_gemma_config_reads_its_defaults_and_tanh_gelu():
    config = model_config_from_hf(GEMMA_2B, "float32")
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"
    assert config.head_dim == 256 and config.sm_scale == 256**-0.5
    assert config.layer_windows == (None,) * 18 and config.final_logit_softcap is None
    # HF 5's rule (vLLM's and transformers 4's read hidden_activation, which no released
    # config sets otherwise than tanh): hidden_act decides.
    config = model_config_from_hf({**GEMMA_2B, "hidden_activation": "gelu"}, "float32")
    assert config.hidden_act == "gelu_pytorch_tanh"
    config = model_config_from_hf({**GEMMA_2B, "hidden_act": "gelu_new"}, "float32")
    assert config.hidden_act == "gelu_new"


def test_gemma2_config_alternates_windows_and_caps_by_default():
    config = model_config_from_hf(GEMMA_2_9B, "float32")
    assert config.layer_windows[:3] == (4096, None, 4096) and len(config.layer_windows) == 42
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.tie_word_embeddings and config.head_dim == 256 and config.vocab_size == 256000
    assert config.option("post_norms") and not config.qk_norm
    uncapped = {**GEMMA_2_9B, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    config = model_config_from_hf(uncapped, "float32")
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (None, None)


def test_gemma3_config_reads_the_window_pattern_and_both_rope_bases():
    config = model_config_from_hf(GEMMA_3_1B, "float32")
    windows = config.layer_windows
    assert windows[:6] == (512,) * 5 + (None,) and windows[24:] == (512, 512)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling) == (1e6, 1e4, None)
    assert config.qk_norm and config.attn_logit_softcap is None and config.head_dim == 256


@pytest.mark.parametrize("layout", ["hub", "transformers 5"])
def test_gemma3_multimodal_config_reads_its_text_config(layout):
    hf_config = GEMMA_3_4B
    if layout == "transformers 5":
        hf_config = transformers.Gemma3Config(
            text_config=GEMMA_3_4B["text_config"], vision_config=GEMMA_3_4B["vision_config"]
        ).to_dict()
        hf_config["architectures"] = GEMMA_3_4B["architectures"]
    config = model_config_from_hf(hf_config, "bfloat16")
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (34, 2560, 262208)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 256)
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 8.0
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.layer_windows[5] is None and config.layer_windows[4] == 1024
    if layout == "hub":
        assert config.eos_token_ids == (1, 106)
        vision = config.option("vision")
        assert (vision.num_layers, vision.num_patches, config.option("image_token_id")) == (
            27,
            4096,
            262144,
        )
        assert config.option("mm_tokens_per_image") == 256


def test_bidirectional_gemma3_is_rejected():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        model_config_from_hf({**GEMMA_3_1B, "use_bidirectional_attention": True}, "float32")
