"""The on-disk XLA cache: entries from before its size limit must not break the limit."""

from jax._src.lru_cache import LRUCache

from jvllm.worker.compilation_cache import date_undated_entries


def test_entries_written_without_a_size_limit_become_the_first_evicted(tmp_path):
    (tmp_path / "old-cache").write_bytes(b"x" * 600)  # written by jvllm without the limit
    (tmp_path / "recent-cache").write_bytes(b"y" * 300)
    (tmp_path / "recent-atime").write_bytes((123).to_bytes(8, "little"))
    date_undated_entries(str(tmp_path))
    assert (tmp_path / "old-atime").read_bytes() == bytes(8)
    assert (tmp_path / "recent-atime").read_bytes() == (123).to_bytes(8, "little")

    cache = LRUCache(str(tmp_path), max_size=1000)  # JAX's own, as the engine configures it
    cache.put("new", b"z" * 300)
    assert sorted(p.name for p in tmp_path.glob("*-cache")) == ["new-cache", "recent-cache"]


def test_missing_cache_dir_is_left_for_jax_to_create(tmp_path):
    date_undated_entries(str(tmp_path / "absent"))
    assert not (tmp_path / "absent").exists()
