"""One check for every model family: a tiny random HF model, saved as an HF directory, decodes
greedily token for token like HF transformers through the whole engine (one batch, chunked
prefill, a prefix-cache hit), in float32."""

import numpy as np
import pytest
import torch
import transformers
from conftest import dense_logits, hf_greedy

from jvllm import LLM, SamplingParams
from jvllm.model_loader.hf import load_hf_dir

# The tiny models' shapes: 2 layers, 4 query heads over 2 KV heads, a 512-token vocabulary.
TINY_SHAPES = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}


def save_random_model(path, hf_config, seed: int = 0, scale: float = 0.15, auto_class=None):
    """An HF model of `hf_config` with O(1) random weights everywhere (biases and norms too),
    so that greedy choices are far from ties and a wrong bias, norm or permutation shows.
    `auto_class`: AutoModelForCausalLM unless given (AutoModel: the base model alone).
    Returns the HF model (float32, eval)."""
    torch.manual_seed(seed)
    auto_class = auto_class or transformers.AutoModelForCausalLM
    model = auto_class.from_config(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name.split(".")[-2:][0]:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, scale)
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "wte" in name else scale)
    model.save_pretrained(path)
    return model


def save_with_correction_biases(path, hf_config):
    """save_random_model, with the routers' e_score_correction_bias (DeepSeek-V3's, GLM-4.5's:
    a buffer, so left 0 there) random, large enough to change which experts are chosen."""
    model = save_random_model(path, hf_config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


TP_VOCAB = 1001  # not a multiple of T: a sharded vocabulary is padded


def save_tp_llama(path, num_kv_heads: int, tie: bool, seed: int = 0) -> str:
    """A 2-layer Llama with 8 query heads, for tensor parallelism up to T = 8."""
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        intermediate_size=96,
        vocab_size=TP_VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    save_random_model(str(path), config, seed=seed)
    return str(path)


def ragged_prompts(vocab_size: int, lengths=(1, 5, 16, 17, 45), seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths (one batch), ids in [0, vocab_size)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def _generate(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_greedy_ignoring_eos(model, prompt, max_tokens):
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        return hf_greedy(model, prompt, max_tokens)
    finally:
        model.generation_config.eos_token_id = eos


def _greedy_engine(path, **kwargs) -> LLM:
    """An LLM whose greedy steps run the GREEDY sampler plan (sample/plan.py): these checks are
    of the model, and a step's switches for every sampling stage took a quarter of their time
    to compile (test_sampler_plans.py checks the plans against the switches)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JVLLM_SAMPLER_PLANS", "1")
        return LLM(str(path), **kwargs)


def assert_matches_hf(path, hf_model, prompts, max_tokens: int = 16, **engine_kwargs) -> None:
    """The engine on `path` (float32) against `hf_model` greedy, token for token: all prompts
    in one batch; again with chunked prefill; then a prompt sharing a cached prefix."""
    expected = [hf_greedy_ignoring_eos(hf_model, p, max_tokens) for p in prompts]
    max_model_len = max(len(p) for p in prompts) + max_tokens + 64
    common = {"dtype": "float32", "max_num_seqs": 8, "max_model_len": max_model_len}
    common.update(engine_kwargs)

    llm = _greedy_engine(path, max_num_batched_tokens=256, **common)
    assert _generate(llm, prompts, max_tokens) == expected, "one batch"

    chunked = _greedy_engine(
        path, max_num_batched_tokens=32, long_prefill_token_threshold=5, **common
    )
    assert _generate(chunked, prompts, max_tokens) == expected, "chunked prefill"

    longest = max(prompts, key=len)
    sharing = longest + [t for t in prompts[1]]  # the longest prompt's blocks are cached
    manager = llm.llm_engine.scheduler.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    assert _generate(llm, [sharing], max_tokens) == [
        hf_greedy_ignoring_eos(hf_model, sharing, max_tokens)
    ], "prefix-cache hit"
    assert manager.prefix_cache_hits > hits_before


def assert_logits_match_hf(path, hf_model, token_ids, atol=1e-4, rtol=1e-7, **dense_kwargs):
    """Our dense forward (conftest's dense_logits, f32[T, V]) on the checkpoint at `path`,
    loaded in float32, against `hf_model`'s logits on the one sequence `token_ids` (T ids):
    allclose within `atol` and `rtol`. `dense_kwargs` go to dense_logits (`positions`).
    Returns the loaded (config, params), for checks of the config."""
    config, params = load_hf_dir(str(path), "float32")
    with torch.no_grad():
        expected = hf_model(torch.as_tensor(np.asarray(token_ids))[None]).logits[0].numpy()
    ours = dense_logits(config, params, token_ids, **dense_kwargs)
    np.testing.assert_allclose(ours, expected, rtol=rtol, atol=atol)
    return config, params


def assert_hf_window_cuts(hf_model, prompt) -> None:
    """HF's own logits on `prompt` change when its sliding window is widened past the prompt:
    in the attention implementation HF runs (eager or sdpa), the window really cuts, so a
    parity check on `prompt` checks the engine's window too."""
    assert hf_model.config._attn_implementation in ("eager", "sdpa")
    window = hf_model.config.sliding_window
    assert window is not None and len(prompt) > window
    with torch.no_grad():
        windowed = hf_model(torch.tensor([prompt])).logits
        hf_model.config.sliding_window = 2 * len(prompt)
        try:
            unwindowed = hf_model(torch.tensor([prompt])).logits
        finally:
            hf_model.config.sliding_window = window
    assert not torch.allclose(windowed, unwindowed, atol=1e-3)
