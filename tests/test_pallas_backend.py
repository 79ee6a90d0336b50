"""attention_backend="pallas" gives the same tokens as "reference" (the kernels in interpret mode
on CPU, compiled on a GPU)."""

import jax
import pytest

from jvllm import LLM, SamplingParams

PREFIX = [(i * 37) % 30000 + 300 for i in range(36)]
PROMPTS = [[17, 4000, 25], PREFIX + [1, 2], list(range(5000, 5021)), PREFIX + [3, 4, 5, 6]]


def _run(model_dir: str, backend: str) -> tuple[list[list[int]], int]:
    llm = LLM(
        model_dir,
        dtype="float32",
        attention_backend=backend,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        long_prefill_token_threshold=12,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    second = llm.generate(PROMPTS[2:], params, use_tqdm=False)  # the last one hits PREFIX
    tokens = [o.outputs[0].token_ids for o in first + second]
    return tokens, second[1].num_cached_tokens


@pytest.fixture
def full_precision_dots():
    """float32 dots at full precision in both engines: on a GPU, XLA's default rounds the
    reference's to TF32, while the kernels ask for full precision (on CPU nothing changes). Set
    globally, not by the context manager: the engine traces its steps on compile threads."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.slow  # the kernels interpreted on CPU over a whole generate: 30-50 s
def test_pallas_backend_matches_reference_with_chunked_prefill_and_prefix_hits(
    tiny_llama_weights_dir, full_precision_dots
):
    reference, _ = _run(tiny_llama_weights_dir, "reference")
    pallas, cached = _run(tiny_llama_weights_dir, "pallas")
    assert cached == 32  # two full blocks of the shared prefix came from the cache
    assert pallas == reference


@pytest.mark.parametrize("block_size", [4, 24])
def test_a_block_size_the_kernels_do_not_take_is_refused_before_loading(
    tiny_llama_weights_dir, block_size
):
    # It used to load, then abort every request in the step with the kernel's ValueError.
    with pytest.raises(ValueError, match=f"block_size={block_size} does not suit"):
        LLM(tiny_llama_weights_dir, attention_backend="pallas", block_size=block_size)
