"""Native CPU kernels through the XLA FFI: built with the system C++ compiler on first use and
registered as XLA:CPU custom-call targets.

The sources live beside this builder, and a wrapper names its kernel by its key in SOURCES, so
what the builder can load is one table that the wheel is tested to hold (an editable install
would hide a file missing from pyproject's package-data).

A kernel's source is compiled into ~/.cache/jvllm/native (or $JVLLM_NATIVE_CACHE_DIR), keyed
by the source, the flags, jax's version and the CPU. It is built for this CPU (-march=native),
or, with JVLLM_NATIVE_ISA=avx2 on an x86 CPU that has AVX2 and FMA, for x86-64-v3 (AVX2, FMA,
F16C), so that a CPU with AVX-512 runs and tests the path of one without; =baseline builds for
the architecture's baseline (x86-64's SSE2), where only simd_lanes.h's portable lines run. The
log names each kernel as it loads and the instruction set it was built for. A machine
without a compiler, a directory that cannot be written or a library that does not load gets
one warning saying how to fix it, and the kernel's caller keeps its pure-JAX path; so does a
kernel switched off by its JVLLM_CPU_*_KERNEL=0, which the log says once.
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import jax

from jvllm.logger import init_logger

logger = init_logger(__name__)

NATIVE_CACHE_DIR_ENV = "JVLLM_NATIVE_CACHE_DIR"
NATIVE_ISA_ENV = "JVLLM_NATIVE_ISA"
# JVLLM_NATIVE_ISA's choices -> the compiler's target flags (x86 for "avx2", and for "baseline"
# x86 or ARM's).
_ISA_FLAGS = {
    "native": ["-march=native"],
    "avx2": ["-march=x86-64-v3"],
    "baseline": ["-march=x86-64"] if platform.machine() in ("x86_64", "AMD64") else [],
}
_DIR = Path(__file__).parent
# Each kernel's source by the name its wrapper passes, and what every kernel may include.
SOURCES = {
    name: _DIR / f"{name}.cc"
    for name in ("cpu_decode", "cpu_dense", "cpu_gguf", "cpu_int8", "cpu_int_group")
}
HEADERS = (
    _DIR / "dense_tile.h",
    _DIR / "parallel_for.h",
    _DIR / "simd.h",
    _DIR / "simd_lanes.h",
)
# One build of a source with its flags at a time: the engine's background build and the thread
# tracing a step may both reach a kernel first, and the second waits for the build in flight
# (a step traced then still gets the kernel, never the pure-JAX path for its life) and finds
# the library built. Different kernels, and one kernel's builds with different flags, build
# side by side (each a compiler process of its own).
_BUILD_LOCKS: dict[tuple[str, ...], threading.Lock] = defaultdict(threading.Lock)
_LOCKS_LOCK = threading.Lock()


def register_targets(kernel: str, targets: tuple[str, ...], what: str, flags: list[str]) -> bool:
    """Build `kernel`'s source (once per key) and register its handler symbols `targets` for
    XLA:CPU; False (logged, naming `what` the kernel does) where that cannot be done."""
    with _build_lock(kernel, flags):
        library = _build(SOURCES[kernel], what, flags)
    if library is None:
        return False
    try:
        loaded = ctypes.cdll.LoadLibrary(str(library))
        handlers = {name: getattr(loaded, name) for name in targets}
        isa = loaded.JvllmIsa  # simd.h's: what the compiler targeted
    except (OSError, AttributeError) as error:
        logger.warning(
            "%s stays pure JAX: loading %s failed (%s); delete it to rebuild", what, library, error
        )
        return False
    for name, handler in handlers.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    isa.restype = ctypes.c_char_p
    if library not in _SAID_LOADED:  # two threads may register a kernel at once
        _SAID_LOADED.add(library)
        logger.info("%s: native kernel for %s (%s)", what, isa().decode(), library.name)
    return True


def dtype_flags(dtype: str) -> list[str]:
    """The flags that build one model dtype's handlers of a kernel ("float32" or "bfloat16"),
    JVLLM_MODEL_BF16 in its source: a model's first process compiles half its templates. A
    source built without them (the tests' drivers) defines both dtypes'."""
    return [f"-DJVLLM_MODEL_BF16={int(dtype == 'bfloat16')}"]


def is_switched_off(env: str, what: str) -> bool:
    """Whether the kernel doing `what` is switched off by `env`=0; the log says so once."""
    if os.environ.get(env, "1") != "0":
        return False
    if env not in _SAID_OFF:
        _SAID_OFF.add(env)
        logger.info("%s: native kernel off (%s=0); the pure-JAX path runs", what, env)
    return True


_SAID_OFF: set[str] = set()
_SAID_LOADED: set[Path] = set()


def build_in_background(kernel: str, what: str, flags: list[str]) -> None:
    """Start building `kernel`'s source in a thread (the compiler runs as a process of its own),
    so that the first register_targets finds it built: the engine overlaps it with loading the
    model. A build that fails here says nothing; register_targets tries again and says why."""

    def build():
        with _build_lock(kernel, flags):
            _build(SOURCES[kernel], what, flags, warn=False)

    threading.Thread(target=build, name="jvllm-native-build", daemon=True).start()


def _build_lock(kernel: str, flags: list[str]) -> threading.Lock:
    with _LOCKS_LOCK:
        return _BUILD_LOCKS[kernel, *flags]


def cpu_has(flag: str) -> bool:
    """Whether the OS lists `flag` (e.g. "avx512_bf16") among this CPU's instruction sets."""
    return flag in _cpu().split()


# What -march=x86-64-v3 (JVLLM_NATIVE_ISA=avx2) lets the compiler emit, as /proc/cpuinfo names
# it: besides AVX2, FMA and F16C, BMI1/2 (shlx), LZCNT ("abm") and MOVBE.
_X86_64_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")


@functools.cache
def _cpu() -> str:
    """This machine's CPU model and instruction set, as far as the OS says (x86's model name and
    flags; ARM's implementer, part and features), with its architecture."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU part")
    return " ".join(
        [platform.machine(), *sorted({line for line in lines if line.startswith(keys)})]
    )


def _target_flags() -> list[str]:
    """The compiler's target flags that JVLLM_NATIVE_ISA asks for, where this CPU runs them;
    else (logged) the machine's own."""
    return _flags_for(os.environ.get(NATIVE_ISA_ENV, "native"))


@functools.cache
def _flags_for(isa: str) -> list[str]:
    """_target_flags for a JVLLM_NATIVE_ISA value, its warning logged once, not once a build."""
    if isa not in _ISA_FLAGS:
        logger.warning(
            "%s=%s is none of %s: building for this CPU", NATIVE_ISA_ENV, isa, list(_ISA_FLAGS)
        )
        isa = "native"
    if isa == "avx2" and not all(cpu_has(flag) for flag in _X86_64_V3):
        logger.warning(
            "%s=avx2 on a CPU without all of x86-64-v3's %s: building for this CPU",
            NATIVE_ISA_ENV,
            ", ".join(_X86_64_V3),
        )
        isa = "native"
    return _ISA_FLAGS[isa]


def _build(source: Path, what: str, extra_flags: list[str], warn: bool = True) -> Path | None:
    """The shared library of `source`, compiled once per source, flags, jax version and CPU;
    None (logged where `warn`) when it cannot be built."""
    compiler = os.environ.get("CXX", "g++")
    flags = ["-O3", *_target_flags(), *extra_flags, "-fPIC", "-std=c++17", "-w"]
    flags += [f"-I{jax.ffi.include_dir()}", f"-I{_DIR}"]
    # -march=native builds for this CPU, so what the OS says of it is part of the key.
    key = f"{compiler} {flags} -shared {jax.__version__} {_cpu()}".encode()
    key += b"".join(path.read_bytes() for path in (source, *HEADERS))
    root = os.environ.get(NATIVE_CACHE_DIR_ENV) or Path.home() / ".cache" / "jvllm" / "native"
    library = Path(root) / f"{source.stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if library.exists():
        return library
    partial = objects = None
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as out:
            partial = Path(out.name)
        objects = partial.with_suffix(".o")
        # Compiled and linked apart, and linked without the compile flags: linking with
        # -ffast-math would add a start-up routine that turns on flush-to-zero for the thread
        # that loads the library, changing its float arithmetic (and with it constants that
        # JAX folds into the traced steps).
        command = [compiler, *flags, "-c", str(source), "-o", str(objects)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        command = [compiler, "-shared", str(objects), "-o", str(partial)]
        subprocess.run(command, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        if partial is not None:
            partial.unlink(missing_ok=True)
        detail = getattr(error, "stderr", None) or error
        (logger.warning if warn else logger.debug)(
            "%s stays pure JAX: building its kernel in %s with %s failed (%s); install a C++ "
            "compiler (or set CXX), or point %s at a writable directory",
            what,
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
    logger.info("built the native kernel for %s: %s", what, library)
    return library
