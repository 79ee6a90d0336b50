"""The on-disk XLA cache: a second process compiles nothing; the least recently used entries go
past the size limit."""

import json
import os
import subprocess
import sys

import pytest

from jvllm.worker.compilation_cache import prune


def _entry(directory, key: str, size: int, used_ns: int) -> None:
    path = directory / f"{key}-cache"
    path.write_bytes(b"x" * size)
    os.utime(path, ns=(used_ns, used_ns))  # (access, modification)


def test_pruning_deletes_the_least_recently_used_entries_past_the_limit(tmp_path):
    _entry(tmp_path, "old", 400, 1_000)
    _entry(tmp_path, "read_lately", 400, 3_000)
    _entry(tmp_path, "middle", 400, 2_000)
    # An entry JAX's own limit dated as used after its file's access time.
    _entry(tmp_path, "dated_by_jax", 400, 500)
    (tmp_path / "dated_by_jax-atime").write_bytes((4_000).to_bytes(8, "little"))
    (tmp_path / "old-atime").write_bytes((0).to_bytes(8, "little"))
    prune(str(tmp_path), max_bytes=900)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["dated_by_jax-atime", "dated_by_jax-cache", "read_lately-cache"]
    prune(str(tmp_path), max_bytes=900)  # within the limit: nothing more goes
    assert sorted(p.name for p in tmp_path.iterdir()) == left


def test_missing_cache_dir_is_left_for_jax_to_create(tmp_path):
    prune(str(tmp_path / "absent"), max_bytes=1)
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
