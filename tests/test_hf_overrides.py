"""vLLM's hf_overrides: config.json keys replaced before the model is built, from the Python API
and the command line."""

import pytest
import torch
import transformers
from family_parity import TINY_SHAPES, assert_matches_hf, ragged_prompts, save_random_model

from jvllm import LLM
from jvllm.engine.arg_utils import EngineArgs
from jvllm.entrypoints.cli import build_parser
from jvllm.entrypoints.engine_flags import engine_kwargs
from jvllm.model_loader.gguf import load_gguf
from jvllm.model_loader.hf import apply_hf_overrides
from jvllm.model_loader.loader import resolve_default_model
from jvllm.rope_config import parse_rope

TINY = {
    **TINY_SHAPES,
    "max_position_embeddings": 256,
    "rope_theta": 500.0,  # low, so that positions rotate fast and a lost base shows
}
LINEAR_4X = {"rope_type": "linear", "factor": 4.0}


def test_rope_scaling_override_decodes_like_hf_with_that_scaling(tmp_path):
    # Saved by transformers 5 (rope_parameters holding the base); the override uses the older
    # rope_scaling key, as vLLM's users write it: the scaling applies over the saved base.
    plain = save_random_model(tmp_path, transformers.LlamaConfig(**TINY))
    scaled_config = transformers.LlamaConfig(
        **TINY, rope_parameters={**LINEAR_4X, "rope_theta": TINY["rope_theta"]}
    )
    scaled = transformers.AutoModelForCausalLM.from_config(scaled_config).float().eval()
    scaled.load_state_dict(plain.state_dict())
    prompts = ragged_prompts(TINY["vocab_size"], lengths=(5, 40, 60))
    with torch.no_grad():
        plain_logits = plain(torch.tensor([prompts[2]])).logits
        scaled_logits = scaled(torch.tensor([prompts[2]])).logits
    assert (plain_logits - scaled_logits).abs().max() > 0.1  # the scaling matters here
    assert_matches_hf(tmp_path, scaled, prompts, hf_overrides={"rope_scaling": LINEAR_4X})


def test_override_reaches_the_engine_and_a_function_may_rewrite_the_config(tmp_path):
    save_random_model(tmp_path, transformers.LlamaConfig(**TINY))
    llm = LLM(str(tmp_path), hf_overrides={"max_position_embeddings": 48, "rope_theta": 123.0})
    assert llm.llm_engine.max_model_len == 48
    assert llm.llm_engine.model_config.rope_theta == 123.0  # over rope_parameters' base

    def halve_context(config: dict) -> dict:
        return {**config, "max_position_embeddings": config["max_position_embeddings"] // 2}

    llm = LLM(str(tmp_path), hf_overrides=halve_context)
    assert llm.llm_engine.max_model_len == TINY["max_position_embeddings"] // 2


def test_nested_configs_are_updated_key_by_key_and_other_keys_replaced():
    config = {
        "text_config": {"hidden_size": 64, "rope_scaling": {"rope_type": "linear", "factor": 2}},
        "rope_scaling": {"rope_type": "linear", "factor": 2},
        "vocab_size": 10,
    }
    overrides = {
        "text_config": {"rope_scaling": {"rope_type": "llama3"}},
        "rope_scaling": {"factor": 8},
    }
    merged = apply_hf_overrides(config, overrides)
    assert merged == {
        "text_config": {"hidden_size": 64, "rope_scaling": {"rope_type": "llama3"}},
        "rope_scaling": {"factor": 8},
        "vocab_size": 10,
    }
    assert config["text_config"]["rope_scaling"]["factor"] == 2  # the input is left as it was


def test_rope_parameters_override_a_transformers_4_rope():
    llama31 = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    rope = parse_rope(apply_hf_overrides(llama31, {"rope_parameters": {**yarn, "rope_theta": 1e6}}))
    assert (rope.theta, rope.scaling.rope_type, rope.scaling.factor) == (1e6, "yarn", 2.0)


def test_gguf_config_takes_overrides():
    config, _ = load_gguf(
        resolve_default_model(),
        keep_packed=True,
        hf_overrides={"max_position_embeddings": 1024, "rope_theta": 5000.0},
    )
    assert (config.max_position_embeddings, config.rope_theta) == (1024, 5000.0)


@pytest.mark.parametrize("bad", [["rope_scaling"], {1: 2}, "rope_theta=5"])
def test_bad_overrides_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        EngineArgs(hf_overrides=bad)


def test_command_line_takes_a_json_object(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--hf-overrides", '{"rope_scaling": {"factor": 2.0}}'])
    assert engine_kwargs(args)["hf_overrides"] == {"rope_scaling": {"factor": 2.0}}
    for bad in ("{rope_scaling: 2}", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--hf-overrides", bad])
        assert "--hf-overrides" in capsys.readouterr().err
