"""The llama.cpp benchmark: without llama-cpp-python, one line on how to install it before any
engine is built; with it (an optional extra), both engines on a tiny workload."""

import sys

import pytest

from jvllm.benchmarks import llama_cpp


def test_llama_cpp_benchmark_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    monkeypatch.setattr(llama_cpp, "LLM", None)  # building jvllm's engine would fail loudly
    with pytest.raises(SystemExit) as exit_info:
        llama_cpp.main([])
    message = str(exit_info.value)
    assert message == llama_cpp.LLAMA_CPP_MISSING and "\n" not in message
    assert "pip install -e '.[bench-llama-cpp]'" in message
    assert "-DGGML_NATIVE=OFF" in message and "-DGGML_AMX_TILE=OFF" in message


def test_llama_cpp_benchmark_runs_both_engines_where_the_package_is_installed(capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra")
    llama_cpp.main(["--input-len", "8", "--output-len", "4", "--num-iters", "1"])
    out = capsys.readouterr().out
    assert "jvllm: first token" in out and "llama.cpp: first token" in out
    assert "ratio jvllm / llama.cpp: decode" in out
