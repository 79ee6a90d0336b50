"""Phi-3 (fused q|k|v and gate|up checkpoints, LongRoPE) through the engine against HF transformers.

LongRoPE uses one factor set for the whole engine, as vLLM does (rope_config.RopeScaling's
`use_long_factor`), where HF picks one per call by the sequence's length: the engine matches HF's
own model wherever the two choices agree, and, past the boundary, an HF model whose short factors
are its long ones.
"""

import numpy as np
import pytest
import torch
import transformers
from conftest import dense_logits
from family_parity import TINY_SHAPES, assert_matches_hf, ragged_prompts, save_random_model

from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {
    **TINY_SHAPES,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
NUM_PAIRS = 8  # head_dim 16 / 2
# Distinct per frequency, and far apart between the sets, so a wrong set or order shows.
SHORT_FACTOR = [1.0 + 0.1 * i for i in range(NUM_PAIRS)]
LONG_FACTOR = [1.5 + 1.5 * i for i in range(NUM_PAIRS)]


def _longrope_config(original: int, short_factor=SHORT_FACTOR) -> transformers.Phi3Config:
    """max_position_embeddings / original > 1, so cos/sin carry an attention factor != 1."""
    rope = {"rope_type": "longrope", "short_factor": short_factor, "long_factor": LONG_FACTOR}
    return transformers.Phi3Config(
        **TINY, original_max_position_embeddings=original, rope_scaling=rope
    )


def test_phi3_decodes_like_hf(tmp_path):
    hf_model = save_random_model(tmp_path, transformers.Phi3Config(**TINY))
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


@pytest.mark.slow  # 16-27 s; LongRoPE past the original context stays in the default run
def test_longrope_within_original_context_uses_short_factors_like_hf(tmp_path):
    # max_model_len <= original: every sequence stays short, HF's choice and ours agree.
    hf_model = save_random_model(tmp_path, _longrope_config(original=64))
    prompts = ragged_prompts(TINY["vocab_size"], lengths=(1, 5, 16, 17, 30))
    assert_matches_hf(tmp_path, hf_model, prompts, max_model_len=64)


def test_longrope_past_original_context_uses_long_factors_at_every_position(tmp_path):
    original = 32
    hf_model = save_random_model(tmp_path, _longrope_config(original))
    # The same weights with the long factors in both sets: HF's model as it runs past the
    # original context, at every length.
    long_model = transformers.Phi3ForCausalLM(_longrope_config(original, LONG_FACTOR)).eval()
    long_model.load_state_dict(hf_model.state_dict())
    prompts = ragged_prompts(TINY["vocab_size"])  # 1 to 45 tokens: most cross 32 as they grow

    # HF's own model past the boundary is that model: a single forward over 45 positions...
    longest = np.asarray(prompts[-1])
    with torch.no_grad():
        expected = hf_model(torch.tensor(longest)[None]).logits[0].numpy()
        long_logits = long_model(torch.tensor(longest)[None]).logits[0].numpy()
    np.testing.assert_array_equal(expected, long_logits)
    # ... which ours matches (long factors: max_position_embeddings, 256, passes 32).
    config, params = load_hf_dir(str(tmp_path), "float32")
    assert config.rope_scaling.use_long_factor
    ours = dense_logits(config, params, longest)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)

    # Through the engine, short prompts included, token for token.
    assert_matches_hf(tmp_path, long_model, prompts)


def _phi3_json(**overrides) -> dict:
    """A config.json in Phi-3-mini-128k's layout (transformers 4: rope_scaling, old names)."""
    rope = {"type": "su", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}
    return {
        **TINY,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {**rope, "original_max_position_embeddings": 999},
        "sliding_window": 262144,
        **overrides,
    }


def test_phi3_config_reads_as_hf_reads_it():
    config = model_config_from_hf(_phi3_json(), "float32")
    scaling = config.rope_scaling
    assert scaling.rope_type == "longrope"  # "su" is its old name
    assert scaling.original_max_position_embeddings == 4096  # the top-level field wins
    assert scaling.attention_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))
    # With no engine around, max_position_embeddings stands for max_model_len (vLLM's default).
    assert scaling.use_long_factor
    assert not config.for_max_model_len(4096).rope_scaling.use_long_factor
    assert config.for_max_model_len(4097).rope_scaling.use_long_factor
    # A window longer than any sequence never cuts: dropped. Phi-3-mini-4k's 2047 cuts.
    assert config.sliding_window is None
    mini_4k = model_config_from_hf(
        _phi3_json(max_position_embeddings=4096, rope_scaling=None, sliding_window=2047),
        "float32",
    )
    assert mini_4k.layer_windows == (2047, 2047)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            "short_factor must give one factor per pair",
        ),
        # A partial rotation (Phi-4-mini's 0.75) runs (test_rope_scaling.py); one over an odd
        # number of dims (16 * 0.7 = 11) does not.
        ({"partial_rotary_factor": 0.7, "rope_scaling": None}, "must rotate an even number"),
    ],
)
def test_phi3_config_rejects_what_it_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(_phi3_json(**overrides), "float32")
