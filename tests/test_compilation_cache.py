"""The on-disk XLA cache: a second process compiles nothing; old entries keep the size limit."""

import json
import os
import subprocess
import sys

import pytest
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


_COUNT_COMPILES = """
import json, sys
from jax import monitoring
counts = {"requests": 0, "hits": 0}
def count(event, **kwargs):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
monitoring.register_event_listener(count)
from jvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
          compile_all_buckets=True)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({**counts, "tokens": out[0].outputs[0].token_ids}))
"""


@pytest.mark.slow  # two processes, the first compiling every bucket: 30 s on 2 cores
def test_a_second_process_compiles_nothing(tmp_path, tiny_llama_weights_dir):
    env = {**os.environ, "JVLLM_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def run():
        result = subprocess.run(
            [sys.executable, "-c", _COUNT_COMPILES, tiny_llama_weights_dir],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["hits"] == 0 and first["requests"] > 0  # a fresh directory: all compiled
    assert second["requests"] == second["hits"] >= 4  # the 4 buckets and every helper: loaded
    assert second["tokens"] == first["tokens"]
