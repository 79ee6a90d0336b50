"""The llama.cpp benchmark without llama-cpp-python: one line on how to install it, before any
engine is built."""

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
