"""The native kernels on ARM, with no ARM machine at hand: every source compiles for aarch64
(Debian's cross compiler), and the dense, int8 and decode attention kernels pass C++ drivers'
random inputs against a scalar reference (tests/native/*_driver.cc) run under qemu-user. On an
aarch64 machine the same runs with its own compiler, natively."""

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
# The kernels that a driver runs -> its source and flags (the decode kernel's: its wrapper's
# -ffast-math); the others only compile.
_DRIVEN = {
    "cpu_dense": ("dense_kernels_driver.cc", "-DJVLLM_DRIVE_DENSE"),
    "cpu_int8": ("dense_kernels_driver.cc", "-DJVLLM_DRIVE_INT8"),
    "cpu_decode": ("decode_kernel_driver.cc", "-ffast-math"),
}
pytestmark = pytest.mark.skipif(
    shutil.which(_COMPILER) is None or not all(map(shutil.which, _RUNNER)),
    reason="needs an aarch64 C++ compiler and, off ARM, qemu-user "
    "(Debian: apt-get install g++-aarch64-linux-gnu qemu-user)",
)


def _compile(*args: str) -> subprocess.Popen:
    """The builder's language and includes, -O2 (a third quicker to build than its -O3)."""
    include = native.SOURCES["cpu_dense"].parent
    flags = ["-O2", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}", f"-I{include}"]
    return subprocess.Popen([_COMPILER, *flags, *args], stderr=subprocess.PIPE, text=True)


def test_every_kernel_compiles_for_arm(tmp_path):
    """Side by side; the driven sources compile in the drivers below."""
    others = sorted(set(native.SOURCES) - set(_DRIVEN))
    builds = {k: _compile("-c", str(native.SOURCES[k]), "-o", str(tmp_path / k)) for k in others}
    for kernel, build in builds.items():
        errors = build.communicate()[1]
        assert build.returncode == 0, f"{kernel}: {errors[-3000:]}"


@pytest.mark.parametrize("kernel", sorted(_DRIVEN))
def test_the_kernels_match_a_scalar_reference_on_arm(kernel, tmp_path):
    source, flag = _DRIVEN[kernel]
    driver = tmp_path / "driver"
    build = _compile(
        "-static", flag, str(_DRIVERS / source), "-o", str(driver)
    )  # static: no ARM libraries
    assert build.wait() == 0, build.communicate()[1][-3000:]
    run = subprocess.run([*_RUNNER, str(driver)], check=False, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.endswith(" 0 failed\n"), run.stdout[-3000:]
