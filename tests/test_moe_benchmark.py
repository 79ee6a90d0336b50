"""The MoE layer benchmark's `main` on the tiny shape, so that it does not break unnoticed (the
other benchmarks' smoke tests are in test_benchmarks.py)."""

import pytest

from jvllm.benchmarks import moe


def test_moe_benchmark_times_grouped_against_dense(capsys):
    moe.main(["--shapes", "tiny", "--num-tokens", "1", "8", "--num-iters", "1"])
    out = capsys.readouterr().out
    assert "CPU: " in out
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [row[1] for row in rows] == ["1", "8"]
    for _, _, grouped, dense, ratio in rows:
        assert float(grouped) > 0 and float(dense) > 0
        assert float(ratio.rstrip("x")) == pytest.approx(float(grouped) / float(dense), rel=0.05)
