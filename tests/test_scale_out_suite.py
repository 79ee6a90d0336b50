"""tests/scale_out/ in a process of its own, on 8 fake CPU devices (see conftest.py)."""

import os
import subprocess
import sys

import pytest
from conftest import SCALE_OUT_ENV

TESTS = os.path.dirname(__file__)


# A subprocess runs the scale-out suite on 8 fake devices: about 11 minutes on 2 busy cores.
@pytest.mark.slow
def test_scale_out_suite_passes_on_eight_cpu_devices():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "scale_out"],
        check=False,
        cwd=TESTS,
        env={**os.environ, SCALE_OUT_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]
