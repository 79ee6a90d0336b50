"""tests/scale_out/ in a process of its own, on 8 fake CPU devices (see conftest.py)."""

import os
import subprocess
import sys

import pytest
from conftest import SCALE_OUT_ENV

TESTS = os.path.dirname(__file__)


@pytest.mark.slow  # a subprocess runs the scale-out suite on 8 fake devices: a minute on 2 cores
def test_scale_out_suite_passes_on_eight_cpu_devices():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "scale_out"],
        check=False,
        cwd=TESTS,
        env={**os.environ, SCALE_OUT_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]
