"""DeepSeek-V2 and V3 under tensor and expert parallelism on the fake CPU devices of this
directory: the query heads cut, MLA's one latent head repeated on every device (the cache a
whole latent row a token on each), the experts cut on F or placed whole; token for token the
one device's."""

import functools

import pytest
from family_parity import ragged_prompts
from test_family_deepseek import _save, v2_lite_like, v3_like

from jvllm import LLM, SamplingParams
from jvllm.models.deepseek import MLA_DISABLE_ENV

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ragged_prompts(512, lengths=(5, 17, 40))
# 4 heads and 8 experts: T = 2 and 4 cut both.
MODELS = {"v2_lite": v2_lite_like, "v3": v3_like}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    @functools.cache
    def save(name: str) -> str:
        path = tmp_path_factory.mktemp(name)
        _save(path, MODELS[name]())
        return str(path)

    return save


def _greedy(path, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, **{**ENGINE_KWARGS, **kwargs})
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def one_device(model_dir):
    return functools.cache(lambda name: _greedy(model_dir(name))[0])


@pytest.mark.parametrize(
    ("name", "t", "expert_parallel"),
    [("v2_lite", 2, False), ("v3", 4, False), ("v2_lite", 4, True), ("v3", 2, True)],
)
def test_deepseek_decodes_as_on_one_device(model_dir, one_device, name, t, expert_parallel):
    tokens, llm = _greedy(
        model_dir(name), tensor_parallel_size=t, enable_expert_parallel=expert_parallel
    )
    assert tokens == one_device(name)
    cache = llm.llm_engine.model_runner.kv_cache  # [L, 1, T, P, B, C + R]: a latent per device
    assert cache.shape[1:3] == (1, t)
    assert {shard.data.shape[2] for shard in cache.addressable_shards} == {1}


def test_decompressed_cache_decodes_as_on_one_device(model_dir, one_device, monkeypatch):
    """JVLLM_MLA_DISABLE=1 under tensor parallelism: each device its heads' keys and values."""
    monkeypatch.setenv(MLA_DISABLE_ENV, "1")
    tokens, llm = _greedy(model_dir("v3"), tensor_parallel_size=2)
    assert tokens == one_device("v3")
    assert llm.llm_engine.model_runner.kv_cache.shape[1:3] == (2, 4)
