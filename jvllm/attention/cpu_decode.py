"""Attention of one-query tiles on CPU as a native kernel (cpu_decode.cc) through the XLA FFI.

XLA:CPU runs the reference backend's decode attention as many small batched products, well
below what reading the KV takes (a SmolLM2 batch-64 step: 66 of 111 ms; BENCHMARKS.md). The
kernel reads each KV head's rows once for its query heads, in float32 from a bfloat16 or
float32 cache, on XLA's intra-op threads, for decode steps and for the decodes of steps with
prefills.

It is built with the system C++ compiler on first use, into ~/.cache/jvllm/native (or
$JVLLM_NATIVE_CACHE_DIR), keyed by the source, the flags, jax's version and the CPU; a machine
without a compiler, or JVLLM_CPU_DECODE_KERNEL=0, keeps the pure-JAX path, which computes the
same attention.
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from jvllm.attention.metadata import Tiles
from jvllm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.cc")
NATIVE_CACHE_DIR_ENV = "JVLLM_NATIVE_CACHE_DIR"
# The cache's storage dtype -> its kernel (kv_quant.py keeps bfloat16 as uint16 bits on CPU).
_TARGETS = {
    jnp.dtype(jnp.uint16): "DecodeAttentionBF16",
    jnp.dtype(jnp.float32): "DecodeAttentionF32",
}


def supports(cache: jax.Array) -> bool:
    """Whether decode attention over `cache` [L, 2, K, P, B, H] can run the kernel here."""
    return (
        cache.dtype in _TARGETS
        and jax.default_backend() == "cpu"
        and os.environ.get("JVLLM_CPU_DECODE_KERNEL", "1") != "0"
        and _register()
    )


def attend_pages(
    q: jax.Array,
    cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    tiles: Tiles,
    flat: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One-query tiles of q f32[T, N, H] (pre-scaled) to the first kv_lens positions of their
    sequence's pages in cache [L, 2, K, P, B, H] at `layer`: `flat`, the unnormalised (max
    f32[T, N], sum f32[T, N], weighted values f32[T, N, H]), with the rows of the tokens the
    tiles read written over, as reference.py's page walk does. Only where `supports(cache)`."""
    if not _register():
        raise RuntimeError("the CPU decode attention kernel could not be built (see the log)")
    results = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in flat)
    call = jax.ffi.ffi_call(_TARGETS[cache.dtype], results, input_output_aliases={7: 0, 8: 1, 9: 2})
    return call(
        q,
        cache,
        jnp.asarray(layer, jnp.int32),
        tables,
        tiles.token_idx[:, 0],
        tiles.seq,
        tiles.kv_lens[:, 0],
        *flat,
    )


@functools.cache
def _register() -> bool:
    library = _build()
    if library is None:
        return False
    try:
        loaded = ctypes.cdll.LoadLibrary(str(library))
        handlers = {name: getattr(loaded, name) for name in _TARGETS.values()}
    except (OSError, AttributeError) as error:
        logger.warning(
            "CPU decode attention stays pure JAX: loading %s failed (%s); delete it to rebuild",
            library,
            error,
        )
        return False
    for name, handler in handlers.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    return True


def _cpu() -> str:
    """This machine's CPU model and instruction set, as far as the OS says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    return " ".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _build() -> Path | None:
    """The kernel's shared library, compiled once per source, flags, jax version and CPU; None
    (logged) when it cannot be built."""
    compiler = os.environ.get("CXX", "g++")
    flags = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c++17", "-w"]
    flags += [f"-I{jax.ffi.include_dir()}"]
    # -march=native builds for this CPU, so what the OS says of it is part of the key.
    key = f"{compiler} {flags} -shared {jax.__version__} {_cpu()}".encode() + _SOURCE.read_bytes()
    root = os.environ.get(NATIVE_CACHE_DIR_ENV) or Path.home() / ".cache" / "jvllm" / "native"
    library = Path(root) / f"cpu_decode-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if library.exists():
        return library
    partial = objects = None
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as out:
            partial = Path(out.name)
        objects = partial.with_suffix(".o")
        # Compiled with -ffast-math but linked without it: linking it in would add a start-up
        # routine that turns on flush-to-zero for the thread that loads the library, changing
        # its float arithmetic (and with it constants that JAX folds into the traced steps).
        command = [compiler, *flags, "-c", str(_SOURCE), "-o", str(objects)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        command = [compiler, "-shared", str(objects), "-o", str(partial)]
        subprocess.run(command, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        if partial is not None:
            partial.unlink(missing_ok=True)
        detail = getattr(error, "stderr", None) or error
        logger.warning(
            "CPU decode attention stays pure JAX: building its kernel in %s with %s failed "
            "(%s); install a C++ compiler (or set CXX), or point %s at a writable directory",
            library.parent,
            compiler,
            str(detail).strip()[:500],
            NATIVE_CACHE_DIR_ENV,
        )
        return None
    finally:
        if objects is not None:
            objects.unlink(missing_ok=True)
    partial.replace(library)  # atomic: a concurrent build sees a whole library or none
    logger.info("built the CPU decode attention kernel: %s", library)
    return library
