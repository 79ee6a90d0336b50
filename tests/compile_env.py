"""How the tests run, set before JAX starts (conftest.py imports this first): no model hub, and
how they compile (docs/testing.md)."""

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
# Sampler plans add executables where some tests count them; test_sampler_plans.py turns them
# on (on a GPU they are the default).
os.environ.setdefault("JVLLM_SAMPLER_PLANS", "0")
# Nothing compiles in background threads (worker/executables.py): the shapes a step queues ahead
# took the two cores from the tests' own steps, mostly for engines that ended before using
# them (family parity tests took twice as long). The tests of background compiles turn them on
# (the `background_compiles` fixture).
os.environ.setdefault("JVLLM_BACKGROUND_COMPILES", "0")
# The tests' compiled executables (thousands, of tiny models) go to a cache of their own, which
# the engine leaves as it finds it (worker/compilation_cache.py), rather than pushing a user's
# out of the engine's; with no size limit, as JAX's own lists every entry at each write
# (docs/testing.md).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "jvllm", "xla-tests"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # as the engine's
# XLA at its lowest optimization level (backend level 0, no costly LLVM passes): the tests'
# tiny models spend their time compiling, which this nearly halves (docs/testing.md: 608 ->
# 348 s for six of the costliest files, cold, none slower); =0 compiles as the engine does.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA takes `flag` (an unknown flag in XLA_FLAGS aborts the process
    at JAX's first device call; a probe process costs under a second)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, check=False, env=env, capture_output=True).returncode == 0


# XLA:CPU's older fusion emitters: the tests' executables compile 1.6-2.8x faster than with its
# MLIR fusion emitters, the default, which the engine keeps (its steps ran 1-3.5% faster with
# them, fp8 weights' conversion 4.7x; docs/testing.md). An XLA_FLAGS of the user's that names
# the flag wins.
_OLD_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and _xla_knows(
    _OLD_FUSION_EMITTERS
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OLD_FUSION_EMITTERS}".strip()
