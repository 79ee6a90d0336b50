"""The native kernels built for an instruction set narrower than the machine's
(JVLLM_NATIVE_ISA, jvllm/native/): AVX2 on an AVX-512 CPU, and the baseline where only the
portable fallbacks run, so that CI on any x86 CPU covers each path; each such build passes the
dense and int8 kernels' tests against XLA, the decode attention kernel's against dense
attention and the grouped kernel's FP8 values, and the log names what each kernel was built
for."""

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jvllm import native
from jvllm.quantization import cpu_dense

_ROOT = Path(__file__).parent.parent
_IS_X86 = platform.machine() in ("x86_64", "AMD64")
pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="builds the kernels with the system C++ compiler"
)
# JVLLM_NATIVE_ISA and what the log names (simd.h's JvllmIsa).
_ISAS = [
    pytest.param(
        "avx2",
        "AVX2 with FMA",
        marks=pytest.mark.skipif(
            not (_IS_X86 and native.cpu_has("avx512f")),
            reason="an x86 CPU with AVX-512: on an AVX2 one the default build is the AVX2 path",
        ),
    ),
    pytest.param(
        "baseline",
        "no vector extension past the baseline",
        marks=[
            pytest.mark.skipif(not _IS_X86, reason="x86's baseline is SSE2, ARM's NEON"),
            pytest.mark.slow,  # AVX2's run covers the same source
        ],
    ),
]


# test_cpu_decode's cases run on each narrower build.
_DECODE_CASES = ("bfloat16-14-2-64", "bfloat16-8-1-128", "float32-10-2-64")


def _run(isa: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, native.NATIVE_ISA_ENV: isa, "JVLLM_LOGGING_LEVEL": "INFO"}
    run = [sys.executable, *args]
    return subprocess.run(run, check=False, cwd=_ROOT, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("isa, named", _ISAS)
def test_a_narrower_build_passes_the_kernels_tests_and_is_named_in_the_log(isa, named):
    says = _run(
        isa, "-c", "from jvllm.quantization import cpu_dense; cpu_dense._register('float32')"
    )
    assert f"CPU dense matmul: native kernel for {named} (" in says.stderr, says.stderr
    # The kernels' products against XLA's and the pure-JAX path (the model-scan tests are
    # the same code on any build), decode attention against dense attention on three
    # shapes (heads of 64 in groups of 4 and 3, of 128 summed in two passes, a float32 cache),
    # and the grouped kernel's FP8 values (float16's conversions on AVX2, integer lanes on the
    # baseline) against fp8_weight's.
    tests = ["tests/test_cpu_dense.py", "tests/test_cpu_int8.py", "tests/test_cpu_decode.py"]
    tests += ["tests/test_fp8_weight.py"]
    tests += ["-k", f"products or identity or on_cpu or {' or '.join(_DECODE_CASES)}"]
    run = _run(isa, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests)
    assert run.returncode == 0, run.stdout[-3000:]


def _log_records(monkeypatch) -> list[logging.LogRecord]:
    """What jvllm.native logs from now on (jvllm's loggers do not propagate to the root)."""
    handler = logging.Handler()
    handler.emit = (records := []).append
    monkeypatch.setattr(native.logger, "handlers", [handler])
    return records


def test_an_isa_the_cpu_cannot_run_builds_for_the_cpu_and_says_why_once(monkeypatch):
    records = _log_records(monkeypatch)
    native._flags_for.cache_clear()
    monkeypatch.setenv(native.NATIVE_ISA_ENV, "avx1024")
    assert native._target_flags() == native._target_flags() == ["-march=native"]
    assert len(records) == 1  # once, not once a kernel's build
    assert "none of ['native', 'avx2', 'baseline']" in records[-1].getMessage()
    monkeypatch.setattr(native, "cpu_has", lambda flag: False)
    native._flags_for.cache_clear()
    monkeypatch.setenv(native.NATIVE_ISA_ENV, "avx2")
    assert native._target_flags() == ["-march=native"]
    assert "without all of x86-64-v3's avx2, fma" in records[-1].getMessage()
    native._flags_for.cache_clear()  # the next test's CPU is the real one


def test_a_kernel_switched_off_says_so_once(monkeypatch):
    records = _log_records(monkeypatch)
    monkeypatch.setattr(native, "_SAID_OFF", set())
    monkeypatch.setenv("JVLLM_CPU_DENSE_KERNEL", "0")
    assert not cpu_dense.supports("float32", 64, 1)
    assert not cpu_dense.supports("bfloat16", 64, 1)
    assert [r.getMessage() for r in records] == [
        "CPU dense matmul: native kernel off (JVLLM_CPU_DENSE_KERNEL=0); the pure-JAX path runs"
    ]
