"""The wheel holds every native source and header the builder can load (jvllm/native/): an
editable install reads them from the checkout, so a file missing from pyproject's package-data
would pass every other test and leave an installed jvllm on its pure-JAX paths."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jvllm import native

_ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_native_source_and_header(tmp_path):
    pytest.importorskip("setuptools", reason="builds the wheel without build isolation")
    # Built from a copy: setuptools reuses a build/ directory it finds, whose stale copies of
    # files would pass, and another test run may be building in the checkout at the same time.
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist")
    shutil.copytree(_ROOT, tree, ignore=skip)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    command += ["--no-index", "--disable-pip-version-check", "-q", "-w", str(tmp_path), str(tree)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    (wheel,) = tmp_path.glob("jvllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    loadable = [*native.SOURCES.values(), *native.HEADERS]
    assert {f"jvllm/native/{path.name}" for path in loadable} - names == set()
