"""GPT-2 and OPT (learned positions, LayerNorm, biases) through the engine against HF
transformers, their config variants' logits, and their checkpoints' two naming schemes."""

import json

import jax
import numpy as np
import pytest
import transformers
from family_parity import (
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)
from safetensors.numpy import load_file, save_file

from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf

VOCAB_SIZE = 512
TINY_GPT2 = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": VOCAB_SIZE,
    "n_positions": 512,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TINY_OPT = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "ffn_dim": 128,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 512,
    "word_embed_proj_dim": 64,
}
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(**TINY_GPT2),
    "opt_pre_norm": lambda: transformers.OPTConfig(**TINY_OPT),
    # opt-350m's layout: post-norm, no final norm, token embedding narrower than the layers.
    "opt_post_norm_projected": lambda: transformers.OPTConfig(
        **{**TINY_OPT, "word_embed_proj_dim": 32},
        do_layer_norm_before=False,
        activation_function="gelu",
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(VOCAB_SIZE))


VARIANTS = {
    "gpt2_untied_n_inner_relu": lambda: transformers.GPT2Config(
        **TINY_GPT2, tie_word_embeddings=False, n_inner=96, activation_function="relu"
    ),
    "opt_no_bias": lambda: transformers.OPTConfig(**TINY_OPT, enable_bias=False),
    "opt_no_affine_norms": lambda: transformers.OPTConfig(
        **TINY_OPT, layer_norm_elementwise_affine=False
    ),
    "opt_removed_final_norm": lambda: transformers.OPTConfig(
        **TINY_OPT, _remove_final_layer_norm=True
    ),
    "opt_untied": lambda: transformers.OPTConfig(
        **{**TINY_OPT, "word_embed_proj_dim": 32}, tie_word_embeddings=False
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_variant_logits_match_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, VARIANTS[name]())
    token_ids = np.random.default_rng(0).integers(0, VOCAB_SIZE, 12)
    positions = np.arange(len(token_ids))
    assert_logits_match_hf(tmp_path, hf_model, token_ids, rtol=1e-4, positions=positions)


# The original checkpoints (openai-community/gpt2, facebook/opt-*) were saved from the bare
# models, without the LM-head wrapper's prefix.
BARE_PREFIX = {"gpt2": "transformer.", "opt_pre_norm": "model."}


@pytest.mark.parametrize("name", list(BARE_PREFIX))
def test_checkpoint_without_the_wrapper_prefix_loads_the_same(tmp_path, name):
    save_random_model(tmp_path / "wrapped", CONFIGS[name]())
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "wrapped/config.json").read_text())
    prefix = BARE_PREFIX[name]
    tensors = load_file(tmp_path / "wrapped/model.safetensors")
    save_file(
        {n.removeprefix(prefix): t for n, t in tensors.items()},
        tmp_path / "bare/model.safetensors",
    )
    _, wrapped = load_hf_dir(str(tmp_path / "wrapped"), "float32")
    _, bare = load_hf_dir(str(tmp_path / "bare"), "float32")
    assert jax.tree.structure(bare) == jax.tree.structure(wrapped)
    for (path, value), expected in zip(
        jax.tree_util.tree_leaves_with_path(bare), jax.tree.leaves(wrapped)
    ):
        np.testing.assert_array_equal(value, expected, err_msg=jax.tree_util.keystr(path))


def test_transposed_checkpoint_tensor_that_does_not_match_is_named(tmp_path):
    save_random_model(tmp_path, CONFIGS["gpt2"]())
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_inner"] = 96  # the saved MLP weights are 4 * 64 wide
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.mlp\.c_fc\.weight' \(256, 64\)"):
        load_hf_dir(str(tmp_path), "float32")


@pytest.mark.parametrize(
    "field, value",
    [
        ("scale_attn_by_inverse_layer_idx", True),
        ("scale_attn_weights", False),
        ("activation_function", "laplace"),
    ],
)
def test_unsupported_gpt2_settings_are_named(field, value):
    hf_config = transformers.GPT2Config(**TINY_GPT2, **{field: value}).to_dict()
    with pytest.raises(ValueError, match=field):
        model_config_from_hf({**hf_config, "architectures": ["GPT2LMHeadModel"]}, "float32")
