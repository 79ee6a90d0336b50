"""The speculative decoding benchmark runs end to end on a tiny workload."""

import pytest

from jvllm.benchmarks import spec_decode


@pytest.mark.parametrize(
    "method",
    ["ngram", *(pytest.param(m, marks=pytest.mark.slow) for m in ("eagle", "eagle3"))],
)
def test_spec_decode_benchmark_compares_speculation_with_plain_decoding(
    method, tiny_llama_dir, capsys
):
    """n-gram drafts, and random EAGLE-1 and EAGLE-3 heads the benchmark writes for the
    target."""
    args = ["--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "6"]
    spec_decode.main([*args, "--num-iters", "1", "--method", method])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ")
    rows = {tuple(line.split()[:2]): line.split() for line in lines[3:-1]}
    assert set(rows) == {(name, t) for name in spec_decode.PROMPTS for t in ("0", "0.7")}
    # float32: the same tokens, greedy and seeded sampled
    assert all(row[-1] == "True" for row in rows.values())
    assert lines[-1].startswith("a round costs ")


@pytest.mark.slow  # a random DeepSeek-V3 of the default model's width and vocabulary: ~1 min
def test_spec_decode_benchmark_writes_a_deepseek_v3_with_an_mtp_layer(capsys):
    args = ["--method", "mtp", "--dtype", "float32", "--max-tokens", "6", "--num-iters", "1"]
    spec_decode.main([*args, "--temperatures", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert "a random DeepSeek-V3 with an MTP layer" in lines[0]
    rows = [line.split() for line in lines[3:-1]]
    assert [row[:2] for row in rows] == [[name, "0"] for name in spec_decode.PROMPTS]
    assert all(row[-1] == "True" for row in rows)
    assert lines[-1].startswith("a round costs ")


@pytest.mark.slow  # three engines: 9 s on a Zen 5
def test_spec_decode_benchmark_runs_windows_of_rounds_beside_one_call_a_round(
    tiny_llama_dir, capsys
):
    """A draft of the target's first layer, with a third engine of 2 rounds a call."""
    args = ["--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "6"]
    args += ["--method", "draft_model", "--draft-layers", "1", "--num-scheduler-steps", "2"]
    spec_decode.main([*args, "--num-iters", "1", "--temperatures", "0,0.7"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[-3:] == ["tok/s", "/spec", "same"]
    rows = [line.split() for line in lines[3:-2]]
    assert len(rows) == 2 * len(spec_decode.PROMPTS)
    # float32: the same tokens with one call a round and in windows
    assert all(row[-4] == row[-1] == "True" for row in rows)
    assert lines[-2].startswith("a round costs ")
    assert lines[-1].startswith("a round in a window costs ")
