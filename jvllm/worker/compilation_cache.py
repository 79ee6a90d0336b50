"""The on-disk XLA compilation cache of the engine's buckets."""

import os

import jax

# Each engine configuration adds about 1 MB a bucket; the least recently used go beyond this.
_COMPILATION_CACHE_MAX_BYTES = 1 << 30
COMPILATION_CACHE_DIR_ENV = "JVLLM_COMPILATION_CACHE_DIR"
_CACHE_SUFFIX, _ATIME_SUFFIX = "-cache", "-atime"


def enable_compilation_cache() -> None:
    """Keep every compiled executable on disk, at most 1 GiB of them, so that a second start-up
    compiles nothing: the buckets (seconds each cold) and the small helpers too (a tenth of a
    second each, which JAX's default minimum of 1 s of compile time would not store).
    The cache lives in `~/.cache/jvllm/xla`, or `$JVLLM_COMPILATION_CACHE_DIR` (`""` turns it
    off); a cache the user configured for JAX (`JAX_COMPILATION_CACHE_DIR`) is left alone.

    The limit is kept here, once a process (`prune`), not by JAX's own size limit: that lists
    every entry and reads its last-use file at each write, under a lock (0.3 s a write with
    6,000 entries, docs/testing.md), which a start-up compiling tens of executables pays."""
    if jax.config.jax_compilation_cache_dir:
        return
    default = os.path.join(os.path.expanduser("~"), ".cache", "jvllm", "xla")
    path = os.environ.get(COMPILATION_CACHE_DIR_ENV, default)
    if path:
        prune(path, _COMPILATION_CACHE_MAX_BYTES)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def prune(path: str, max_bytes: int) -> None:
    """Delete the least recently used entries of the cache at `path` until its entries hold at
    most `max_bytes`. An entry's last use is its file's access time (a read sets it, within a
    day under Linux's default relatime), or the last-use file JAX's own size limit wrote beside
    it where that is later (jvllm kept JAX's limit before 2026-11-30)."""
    if not os.path.isdir(path):
        return
    entries = []  # (last use in ns, bytes, key)
    total = 0
    with os.scandir(path) as listing:
        for item in listing:
            if not item.name.endswith(_CACHE_SUFFIX):
                continue
            stat = item.stat()
            key = item.name.removesuffix(_CACHE_SUFFIX)
            entries.append((max(stat.st_atime_ns, _jax_last_use(path, key)), stat.st_size, key))
            total += stat.st_size
    entries.sort()
    for _, size, key in entries:
        if total <= max_bytes:
            break
        for suffix in (_CACHE_SUFFIX, _ATIME_SUFFIX):
            try:
                os.remove(os.path.join(path, key + suffix))
            except FileNotFoundError:
                pass
        total -= size


def _jax_last_use(path: str, key: str) -> int:
    """The last use JAX's size limit recorded for an entry (ns), or 0."""
    try:
        with open(os.path.join(path, key + _ATIME_SUFFIX), "rb") as f:
            return int.from_bytes(f.read(8), "little")
    except FileNotFoundError:
        return 0
