"""A pooling runner in a group of data-parallel ranks whose MoE layers run across them (D = 2 on
fake CPU devices, worker/rank_group.py): every rank's pooling step is one call of the group, its
experts spread over every device, and the embeddings equal one device's, through chunked
prefill (a prompt longer than a step) and with a rank that has nothing to pool."""

import numpy as np
import pytest
from family_parity import ragged_prompts, save_random_model
from test_expert_parallel import FAMILIES
from test_families_tp import FAMILY_VOCAB

from jvllm import LLM, PoolerConfig

# Longer than max_num_batched_tokens (16): the 40-token prompt is pooled over three chunks.
PROMPTS = ragged_prompts(FAMILY_VOCAB, lengths=(3, 9, 40, 14, 1))
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 16, "max_num_seqs": 4, "runner": "pooling"}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mixtral")
    save_random_model(path, FAMILIES["mixtral"]())
    return str(path)


def _embeddings(llm: LLM, prompts) -> np.ndarray:
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return np.stack([np.asarray(o.outputs.embedding, np.float32) for o in outputs])


@pytest.mark.parametrize(("t", "pooling_type"), [(1, "LAST"), (2, "MEAN")])
def test_ranks_pool_in_one_step_and_give_one_devices_embeddings(mixtral, t, pooling_type):
    pooler = PoolerConfig(pooling_type=pooling_type)
    want = _embeddings(LLM(mixtral, pooler_config=pooler, **ENGINE), PROMPTS)
    group = LLM(
        mixtral,
        data_parallel_size=2,
        tensor_parallel_size=t,
        enable_expert_parallel=True,
        pooler_config=pooler,
        **ENGINE,
    )
    np.testing.assert_allclose(_embeddings(group, PROMPTS), want, rtol=1e-5, atol=1e-5)
    runner = group.llm_engine.group.group_runner()
    assert runner.num_group_steps > 0 and runner.executables.kinds == ("pool",)
    # One prompt: rank 1 has nothing to pool and steps padding.
    np.testing.assert_allclose(_embeddings(group, PROMPTS[2:3]), want[2:3], rtol=1e-5, atol=1e-5)
