"""The examples run as written, on the default model."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_offline_inference_example_prints_the_four_prompts():
    lines = [
        line for line in _run("offline_inference.py").splitlines() if line.startswith("Prompt:")
    ]
    assert len(lines) == 4
    assert "The capital of France is" in lines[2]
    assert all("Generated: ''" not in line for line in lines)


@pytest.mark.slow  # the example loads the default model in a process of its own: 15 s
def test_trace_request_example_prints_the_lifecycle():
    out = _run("trace_request.py")
    assert out.count("FINISHED_LENGTH") == 2
    assert "Event(request_id='req-0', status='RUNNING', num_computed_tokens=1, num_tokens=2)" in out
    # The chunked half's 6-token prompt, 2 tokens a step.
    assert "status='RUNNING', num_computed_tokens=4, num_tokens=6)" in out


def test_jitted_step_loop_example_matches_generate_and_times_both_k():
    out = _run("jitted_step_loop.py", "--num-steps", "32")  # asserts its tokens itself
    assert "the loop's tokens equal LLM.generate's" in out
    assert "k= 1:" in out and "k=32:" in out
    assert out.count("mean entropy") == 4
