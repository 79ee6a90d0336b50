"""The native kernels on ARM, with no ARM machine at hand: each kernel's source, built for aarch64
(Debian's cross compiler) into a C++ driver of its loops (tests/native/*_driver.cc), passes the
driver's random inputs against a scalar reference run under qemu-user. On an aarch64 machine the
same runs with its own compiler, natively."""

import platform
import shutil
import subprocess
from pathlib import Path

import jax
import pytest

from jvllm import native

_IS_ARM = platform.machine() in ("aarch64", "arm64")
_COMPILER = "g++" if _IS_ARM else "aarch64-linux-gnu-g++"
_RUNNER = [] if _IS_ARM else ["qemu-aarch64"]
_DRIVERS = Path(__file__).parent / "native"
# Each kernel -> its driver's source and flags: its wrapper's (the decode kernel's -ffast-math,
# the GGUF and grouped-integer kernels' -ffp-contract=off, under which their values are the
# format's bit for bit). The GGUF driver runs the float32 and the bfloat16 model's loops in one
# build: the builder's -DJVLLM_MODEL_BF16 only picks which handlers a build defines.
_DRIVEN = {
    "cpu_dense": ("dense_kernels_driver.cc", "-DJVLLM_DRIVE_DENSE"),
    "cpu_int8": ("dense_kernels_driver.cc", "-DJVLLM_DRIVE_INT8"),
    "cpu_decode": ("decode_kernel_driver.cc", "-ffast-math"),
    "cpu_gguf": ("gguf_kernel_driver.cc", "-ffp-contract=off"),
    "cpu_int_group": ("int_group_kernel_driver.cc", "-ffp-contract=off"),
}
pytestmark = pytest.mark.skipif(
    shutil.which(_COMPILER) is None or not all(map(shutil.which, _RUNNER)),
    reason="needs an aarch64 C++ compiler and, off ARM, qemu-user "
    "(Debian: apt-get install g++-aarch64-linux-gnu qemu-user)",
)


def _compile(*args: str) -> subprocess.CompletedProcess:
    """The builder's language and includes, -O2 (a third quicker to build than its -O3)."""
    include = native.SOURCES["cpu_dense"].parent
    flags = ["-O2", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}", f"-I{include}"]
    return subprocess.run([_COMPILER, *flags, *args], check=False, capture_output=True, text=True)


def test_every_kernel_has_a_driver():
    """A kernel is built for ARM only in its driver, so a new one needs its own in tests/native."""
    assert set(_DRIVEN) == set(native.SOURCES)


@pytest.mark.parametrize("kernel", sorted(_DRIVEN))
def test_the_kernels_match_a_scalar_reference_on_arm(kernel, tmp_path):
    source, flag = _DRIVEN[kernel]
    driver = tmp_path / "driver"
    build = _compile(
        "-static", flag, str(_DRIVERS / source), "-o", str(driver)
    )  # static: no ARM libraries
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([*_RUNNER, str(driver)], check=False, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.endswith(" 0 failed\n"), run.stdout[-3000:]
