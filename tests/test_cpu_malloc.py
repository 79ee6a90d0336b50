"""Malloc tuned before JAX starts: XLA:CPU's large temporaries come back without page faults."""

import os
import subprocess
import sys

import jax
import pytest

from jvllm.cpu_malloc import MALLOC_TUNING_ENV, keep_freed_memory

# A jitted step with 48 MiB of temporaries (over glibc's 32 MiB mmap ceiling), called 20 times
# after 5 warm-up calls (the heap settles in them); prints whether the tuning applied and the
# page faults a call.
_SCRIPT = """
import resource, sys
from jvllm.cpu_malloc import keep_freed_memory
applied = keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w: jax.nn.softmax(jnp.tanh(x @ w)).argmax(-1))
x, w = jnp.ones((256, 576)), jnp.full((576, 49152), 1e-3)
for _ in range(5):
    f(x, w).block_until_ready()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    f(x, w).block_until_ready()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) // 20)
"""


def _run(tuning: str) -> tuple[bool, int]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{MALLOC_TUNING_ENV: tuning})
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, check=True, capture_output=True, text=True
    )
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.slow  # two processes timing large temporaries: 20 s on 2 cores
def test_tuned_malloc_reuses_the_pages_of_large_temporaries():
    applied, faults = _run("1")
    untuned_applied, untuned_faults = _run("0")
    assert applied and not untuned_applied
    assert untuned_faults > 5000  # 48 MiB and more faulted in again on every call
    assert faults < untuned_faults / 10  # 600-1,800 against 40,000 here


def test_malloc_is_left_alone_once_jax_is_running():
    jax.devices()  # XLA's threads exist: too late to choose their arenas
    assert keep_freed_memory() is False
