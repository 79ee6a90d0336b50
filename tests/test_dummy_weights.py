"""load_format="dummy": random weights from a config.json alone (vLLM's option of that name)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest
import transformers

from jvllm import LLM, SamplingParams
from jvllm.entrypoints.cli import build_parser
from jvllm.entrypoints.engine_flags import engine_kwargs
from jvllm.model_loader.dummy import dummy_params
from jvllm.model_loader.hf import read_hf_config
from jvllm.model_loader.loader import load_model
from jvllm.models.model import param_shapes


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory) -> str:
    """A model directory with a config.json and nothing else: no weights, no tokenizer."""
    path = tmp_path_factory.mktemp("config_only")
    transformers.Qwen2Config(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=256,
    ).save_pretrained(path)
    assert sorted(os.listdir(path)) == ["config.json"]
    return str(path)


def test_dummy_params_have_the_declared_shapes_and_uniform_values(config_only_dir):
    config = read_hf_config(config_only_dir, "bfloat16")
    params = dummy_params(config)
    declared = param_shapes(config)
    assert jax.tree.structure(params) == jax.tree.structure(declared)
    for array, spec in zip(jax.tree.leaves(params), jax.tree.leaves(declared)):
        assert (array.shape, array.dtype) == (spec.shape, spec.dtype)
        values = np.asarray(array, dtype=np.float32)
        # Uniform in [-1e-3, 1e-3]: standard deviation 1e-3 / sqrt(3).
        assert np.abs(values).max() <= 1e-3
        assert values.std() == pytest.approx(1e-3 / np.sqrt(3), rel=0.2)
    # Layers get their own draws, and a seed gives the same weights again.
    qkv = params["layers"]["attn"]["qkv"]["weight"]
    assert not np.array_equal(qkv[0], qkv[1])
    again = dummy_params(config)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, params, again)))


def test_engine_generates_from_a_directory_without_weights(config_only_dir):
    def run() -> list[list[int]]:
        llm = LLM(
            config_only_dir,
            load_format="dummy",
            dtype="float32",
            max_num_seqs=4,
            max_num_batched_tokens=64,
        )
        outputs = llm.generate(
            [[5, 6, 7], list(range(10, 50))],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outputs]

    first = run()
    assert [len(ids) for ids in first] == [6, 6]
    assert all(0 <= t < 256 for ids in first for t in ids)
    assert run() == first  # the same random weights every time


def test_without_dummy_a_directory_without_weights_is_refused(config_only_dir):
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(config_only_dir)


def test_bad_load_format_is_refused_naming_the_field(config_only_dir, tmp_path):
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(config_only_dir, load_format="pt")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="needs an HF model directory"):
        load_model(str(gguf), load_format="dummy")


def test_cli_passes_load_format_to_the_engine(config_only_dir):
    args = build_parser().parse_args(["serve", config_only_dir, "--load-format", "dummy"])
    assert engine_kwargs(args)["load_format"] == "dummy"
