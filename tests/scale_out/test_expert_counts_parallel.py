"""Per-expert token counts under expert parallelism on fake CPU devices: each device routes
every token with the whole router, so the counts it returns are the global ones, the same as
one device's (layers/expert_counts.py)."""

import numpy as np
import pytest
from family_parity import ragged_prompts, save_random_model
from test_expert_parallel import FAMILIES
from test_families_tp import FAMILY_VOCAB
from test_family_gpt_oss import _save_gpt_oss

from jvllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ragged_prompts(FAMILY_VOCAB, lengths=(1, 9, 30))


def _counts(path: str, **kwargs) -> tuple[np.ndarray, int]:
    """(the runner's counts after PROMPTS, the tokens the steps fed)."""
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    num_fed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs)
    return llm.llm_engine.model_runner.expert_token_counts, num_fed


# gpt-oss counts where it routes as Mixtral does; its engines cost another minute.
@pytest.mark.parametrize("name", ["mixtral", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_expert_parallel_counts_equal_one_devices(tmp_path, name):
    config = FAMILIES[name]()
    (_save_gpt_oss if name == "gpt_oss" else save_random_model)(tmp_path, config)
    one, num_fed = _counts(str(tmp_path))
    spread, _ = _counts(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True)
    np.testing.assert_array_equal(spread, one)
    assert one.shape == (config.num_hidden_layers, config.num_local_experts)
    assert one.sum() == num_fed * config.num_experts_per_tok * config.num_hidden_layers
