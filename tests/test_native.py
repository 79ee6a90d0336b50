"""Native CPU kernels (jvllm/native/): on a machine that cannot build them each keeps its
pure-JAX path and says how to fix it; on one that can, the engine starts the builds its model
needs before the load, and a first use waits for a build in flight rather than keeping the
pure-JAX path."""

import ctypes
import logging
import shutil
import threading

import jax.numpy as jnp
import pytest
from conftest import join_native_builds

from jvllm import native
from jvllm.attention import cpu_decode
from jvllm.quantization import build_kernels_early, cpu_dense, cpu_gguf, cpu_int8, cpu_int_group

_KERNELS = {
    "decode attention": (cpu_decode, lambda: cpu_decode.supports(jnp.zeros((1, 2, 1, 1, 1, 1)))),
    "GGUF matmul": (cpu_gguf, lambda: cpu_gguf.supports("float32")),
    "int8 matmul": (cpu_int8, lambda: cpu_int8.supports(jnp.zeros((4, 32), jnp.int8), "bfloat16")),
    "dense matmul": (cpu_dense, lambda: cpu_dense.supports(jnp.float32, 32, 1)),
    "grouped-integer matmul": (
        cpu_int_group,
        lambda: cpu_int_group.supports("float32", 4, 32, jnp.bfloat16),
    ),
}


@pytest.mark.parametrize("kernel", list(_KERNELS))
def test_no_compiler_keeps_the_pure_jax_path_and_says_so(kernel, tmp_path, monkeypatch):
    module, supported = _KERNELS[kernel]
    monkeypatch.setenv("JVLLM_NATIVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    records = []  # jvllm's loggers do not propagate to the root
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(native.logger, "handlers", [handler])
    module._register.cache_clear()
    try:
        assert not supported()
        assert any(
            kernel in r.getMessage() and "install a C++ compiler" in r.getMessage() for r in records
        )
        assert list(tmp_path.iterdir()) == []  # nothing half-built is left behind
        # A cache directory that cannot be made (a file is in the way) is no worse.
        monkeypatch.delenv("CXX")
        monkeypatch.setenv("JVLLM_NATIVE_CACHE_DIR", str(tmp_path / "file" / "native"))
        (tmp_path / "file").write_text("")
        module._register.cache_clear()
        assert not supported()
        assert "writable directory" in records[-1].getMessage()
    finally:
        module._register.cache_clear()


@pytest.mark.skipif(shutil.which("g++") is None, reason="builds with the system C++ compiler")
def test_the_engine_starts_building_the_decode_kernel_before_its_first_use(tmp_path, monkeypatch):
    from jvllm.attention.backends import prepare_backend

    monkeypatch.setenv("JVLLM_NATIVE_CACHE_DIR", str(tmp_path))
    prepare_backend("reference", "fp8", 16, "float32")  # a quantized cache: the kernel reads none
    prepare_backend("pallas", "auto", 16, "float32")
    join_native_builds()
    assert list(tmp_path.iterdir()) == []
    prepare_backend("reference", "auto", 16, "float32")
    join_native_builds()
    assert [p.name.startswith("cpu_decode-") for p in tmp_path.glob("*.so")] == [True]
    # The model dtype's handler alone: the first process compiles half the templates.
    library = ctypes.CDLL(str(next(tmp_path.glob("*.so"))))
    assert hasattr(library, "DecodeAttentionF32") and not hasattr(library, "DecodeAttentionBF16")


def test_a_background_build_that_fails_leaves_the_warning_to_the_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("JVLLM_NATIVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    monkeypatch.setattr(native.logger, "handlers", [handler])
    cpu_decode.build_early("float32")
    join_native_builds()
    assert records == []
    cpu_decode._register.cache_clear()
    try:
        assert not cpu_decode.supports(jnp.zeros((1, 2, 1, 1, 1, 1)))
        assert len(records) == 1 and "install a C++ compiler" in records[0].getMessage()
    finally:
        cpu_decode._register.cache_clear()


@pytest.mark.skipif(shutil.which("g++") is None, reason="builds with the system C++ compiler")
def test_a_first_use_waits_for_the_build_in_flight_and_gets_the_kernel(tmp_path, monkeypatch):
    """A step traced while its kernel still builds in the background (the engine's early
    build) gets the kernel, not the pure-JAX path for the step's life."""
    source = tmp_path / "tiny.cc"
    source.write_text(
        '#include "xla/ffi/api/ffi.h"\n'
        'extern "C" const char* JvllmIsa() { return "test"; }\n'
        "static xla::ffi::Error nothing() { return xla::ffi::Error::Success(); }\n"
        "XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmTestWaitTarget, nothing, xla::ffi::Ffi::Bind());\n"
    )
    gate = tmp_path / "gate"  # the compiler starts only once it exists
    compiler = tmp_path / "slow-g++"
    compiler.write_text(f'#!/bin/sh\nwhile [ ! -e {gate} ]; do sleep 0.01; done\nexec g++ "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setitem(native.SOURCES, "tiny", source)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("JVLLM_NATIVE_CACHE_DIR", str(tmp_path / "cache"))
    native.build_in_background("tiny", "a test kernel", [])
    registered = []
    first_use = threading.Thread(
        target=lambda: registered.append(
            native.register_targets("tiny", ("JvllmTestWaitTarget",), "a test kernel", [])
        )
    )
    first_use.start()
    first_use.join(0.5)
    assert first_use.is_alive() and registered == []  # waiting, not giving up
    gate.touch()
    first_use.join()
    join_native_builds()
    assert registered == [True]
    assert len(list((tmp_path / "cache").glob("tiny-*.so"))) == 1  # built once


@pytest.mark.parametrize(
    "quantization, dtype, prequantized, kernels",
    [
        (None, "float32", False, ["cpu_dense"]),
        ("gguf", "float32", False, ["cpu_gguf"]),  # packed weights never reach the float kernel
        ("gguf", "bfloat16", False, ["cpu_gguf"]),
        ("int8", "bfloat16", False, ["cpu_int8", "cpu_dense"]),
        (None, "bfloat16", True, ["cpu_int_group", "cpu_dense"]),  # GPTQ, AWQ, int4 / 8, FP8
    ],
)
def test_the_engine_starts_building_the_matmul_kernels_its_weights_use(
    quantization, dtype, prequantized, kernels, monkeypatch
):
    started = []
    monkeypatch.setattr(native, "build_in_background", lambda kernel, *_: started.append(kernel))
    build_kernels_early(quantization, dtype, prequantized)
    assert started == kernels
