"""The quality measures (jvllm/benchmarks/quality.py) that the quantization tests build on: the
perplexity of the shipped text, greedy agreement, and the CLI's `key=value` engine options."""

import math

import pytest

from jvllm import LLM
from jvllm.benchmarks import quality
from tests.conftest import SMOLLM2_ENGINE_KWARGS

# The shared test settings, with room for the 572-token perplexity text.
_ENGINE_KWARGS = {**SMOLLM2_ENGINE_KWARGS, "max_model_len": 1024}


@pytest.fixture(scope="module")
def float32_llm() -> LLM:
    return LLM(**_ENGINE_KWARGS)


@pytest.fixture(scope="module")
def float32_perplexity(float32_llm) -> float:
    return quality.perplexity(float32_llm)


def test_perplexity_of_the_shipped_text_is_plausible_in_float32(float32_perplexity):
    # A 135M model on Austen: 16.8 here; a broken model gives thousands (uniform: 49152).
    assert math.isfinite(float32_perplexity)
    assert 5 < float32_perplexity < 40


def test_bfloat16_perplexity_is_within_two_percent_of_float32(
    float32_perplexity, smollm2_bfloat16_llm
):
    bfloat16 = quality.perplexity(smollm2_bfloat16_llm)
    assert abs(bfloat16 / float32_perplexity - 1) < 0.02


def test_a_config_agrees_with_itself_on_every_greedy_token(float32_llm):
    reference = quality.greedy_token_ids(float32_llm)
    agreement = quality.greedy_agreement(quality.greedy_token_ids(float32_llm), reference)
    assert agreement.common_prefix_lens == (16,) * len(quality.GREEDY_PROMPTS)
    assert agreement.num_all_equal == 16 and agreement.median_common_prefix == 16


def test_greedy_agreement_counts_tokens_until_the_first_difference():
    reference = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    agreement = quality.greedy_agreement([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4]], reference, 4)
    assert agreement.common_prefix_lens == (4, 1, 0)
    assert agreement.num_all_equal == 1 and agreement.median_common_prefix == 1
    with pytest.raises(ValueError, match="2 prompts' tokens against 3"):
        quality.greedy_agreement(reference[:2], reference, 4)


def test_engine_kwargs_parse_as_int_float_bool_none_or_str():
    kwargs = quality.parse_engine_kwargs(
        [
            "dtype=bfloat16",
            "max_num_seqs=8",
            "gpu_memory_utilization=0.5",
            "enable_prefix_caching=false",
            "attention_backend=None",
            "quantization=int8",
        ]
    )
    assert kwargs == {
        "dtype": "bfloat16",
        "max_num_seqs": 8,
        "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": False,
        "attention_backend": None,
        "quantization": "int8",
    }
    assert type(kwargs["max_num_seqs"]) is int
    for bad in ("dtype", "=float32", "max num=1"):
        with pytest.raises(ValueError, match="expected key=value"):
            quality.parse_engine_kwargs([bad])


def test_quality_cli_prints_each_config_against_the_baseline(
    tiny_llama_dir, tmp_path, monkeypatch, capsys
):
    # The tiny model takes 512 positions: a shorter text than the shipped one.
    text = tmp_path / "text.txt"
    text.write_text(quality.perplexity_text()[:1000])
    monkeypatch.setattr(quality, "PERPLEXITY_TEXT_PATH", str(text))
    quality.main(
        [
            *("--model", tiny_llama_dir, "--baseline", "dtype=float32"),
            *("--compare", "dtype=float32", "enable_prefix_caching=false"),
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["config", "perplexity", "ratio", "all", "equal", "median", "prefix"]
    # The same weights and precision: the same perplexity and greedy tokens.
    assert lines[2].startswith("dtype=float32 ")
    assert lines[3].startswith("dtype=float32 enable_prefix_caching=false ")
    for line in lines[2:]:
        assert line.split()[-3:] == ["1.000", "16/16", "16"]
