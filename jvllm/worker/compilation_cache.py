"""The on-disk XLA compilation cache of the engine's buckets."""

import os

import jax

# Each engine configuration adds about 1 MB a bucket; the least recently used go beyond this.
_COMPILATION_CACHE_MAX_BYTES = 1 << 30
COMPILATION_CACHE_DIR_ENV = "JVLLM_COMPILATION_CACHE_DIR"


def enable_compilation_cache() -> None:
    """Keep every compiled executable on disk, at most 1 GiB of them, so that a second start-up
    compiles nothing: the buckets (seconds each cold) and the small helpers too (a tenth of a
    second each, which JAX's default minimum of 1 s of compile time would not store).
    The cache lives in `~/.cache/jvllm/xla`, or `$JVLLM_COMPILATION_CACHE_DIR` (`""` turns it
    off); a cache the user configured for JAX (`JAX_COMPILATION_CACHE_DIR`) is left alone."""
    if jax.config.jax_compilation_cache_dir:
        return
    default = os.path.join(os.path.expanduser("~"), ".cache", "jvllm", "xla")
    path = os.environ.get(COMPILATION_CACHE_DIR_ENV, default)
    if path:
        date_undated_entries(path)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_compilation_cache_max_size", _COMPILATION_CACHE_MAX_BYTES)


def date_undated_entries(path: str) -> None:
    """Give entries written without a size limit (jvllm before 2026-11-22) the last-use file
    that JAX's size limit needs, as the oldest: without it JAX fails every later write to the
    cache (a warning, then a cold compile at every start-up)."""
    if not os.path.isdir(path):
        return
    for name in os.listdir(path):
        if name.endswith("-cache"):
            atime = os.path.join(path, name.removesuffix("-cache") + "-atime")
            if not os.path.exists(atime):
                with open(atime, "wb") as f:
                    f.write(bytes(8))  # time 0, little-endian int as JAX reads it
