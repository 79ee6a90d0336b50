"""tools/gpu_session.sh calls the benchmarks with flags that their parsers take: a typo found on
the GPU machine costs minutes of a task's only quarter hour of device time."""

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "tools", "gpu_session.sh")
_STEPS = [
    *(
        "layers",
        "issue-45",
        "issue-22",
        "issue-17",
        "issue-18",
        "spec-8b",
        "plans",
        "window-checks",
        "check",
        "bench-decode",
    ),
    *("cond-sync", "scan-slices", "bench-mixed", "mla"),
    *("engine-small", "engine-8b", "engine-gemma", "engine-moe", "engine-steps"),
]


class _Parsed(Exception):
    """Raised once a benchmark's arguments parse: nothing after that runs."""


def _recorded_commands(tmp_path, steps: list[str]) -> list[list[str]]:
    """The python3 command lines the steps run, recorded by a stand-in python3."""
    record = tmp_path / "commands.jsonl"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "python3"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "with open(os.environ['RECORD'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    stand_in.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record))
    env["OUT"] = str(tmp_path / "out")
    tokenizer = tmp_path / "tokenizer"  # what the 8B shapes' steps need carried: a stand-in
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    env["GPU_SESSION_TOKENIZER"] = str(tokenizer)
    subprocess.run(["bash", _SCRIPT, *steps], env=env, check=True, capture_output=True)
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_every_step_runs_python_modules_the_repo_has(tmp_path):
    commands = _recorded_commands(tmp_path, _STEPS)
    modules = {argv[1] for argv in commands if argv[0] == "-m"}
    assert {"jvllm.benchmarks.throughput", "jvllm.benchmarks.weight_read"} <= modules
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module


def test_every_benchmark_call_parses(tmp_path, monkeypatch):
    commands = [
        argv
        for argv in _recorded_commands(tmp_path, _STEPS)
        if argv[0] == "-m" and argv[1].startswith(("jvllm.benchmarks.", "kernels_pallas."))
    ]
    assert len(commands) >= 10
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        parse_args(parser, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for argv in commands:
        monkeypatch.setattr(sys, "argv", [argv[1], *argv[2:]])
        with pytest.raises(_Parsed):  # not SystemExit: argparse took every flag
            importlib.import_module(argv[1]).main()
