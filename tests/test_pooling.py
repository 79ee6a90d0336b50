"""Embedding (pooling) models: a tiny random Qwen3 served with runner="pooling", its
embeddings against HF's base model (last_hidden_state, after the final norm) pooled LAST /
MEAN / CLS, through chunked prefill, a prefix-cache hit and a sentence-transformers layout."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from family_parity import TINY_SHAPES, ragged_prompts, save_random_model

from jvllm import LLM, PoolerConfig, PoolingParams, SamplingParams

# Longer than max_num_batched_tokens: the 45-token prompt is pooled over 3 chunks.
PROMPTS = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(1, 5, 17, 45))
# Long prompts side by side in 4-token chunks: 5 KV blocks run out, and prompts are preempted.
CROWDED = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(45, 40, 33, 17))
# A prompt at max_model_len: a pooling request needs no room for an output token.
MAX_MODEL_LEN = 64
CHUNKED = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_embed")
    save_random_model(str(path), transformers.Qwen3Config(**TINY_SHAPES, head_dim=32))
    return str(path)


@pytest.fixture(scope="module")
def hf_hidden(model_dir):
    """prompt -> HF's last_hidden_state f32[n, D] (AutoModel: the base model, final norm)."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def hidden(prompt):
        with torch.no_grad():
            return model(torch.tensor([prompt])).last_hidden_state[0].numpy()

    return hidden


def _hf_embedding(hidden: np.ndarray, pooling_type: str, normalize: bool, dims=None):
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    vector = torch.tensor(vector[:dims])
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


def _assert_embeddings(outputs, expected) -> None:
    assert len(outputs) == len(expected)
    for output, want in zip(outputs, expected):
        got = np.asarray(output.outputs.embedding, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_last_pooling_matches_hf_through_chunks_and_a_prefix_hit(model_dir, hf_hidden):
    """The default for a decoder (LAST, normalized), in one batch whose long prompt takes three
    chunks; a prompt sharing its first blocks then hits the prefix cache (LAST keeps it)."""
    llm = LLM(model_dir, runner="pooling", **CHUNKED)
    prompts = [*PROMPTS, list(range(1, MAX_MODEL_LEN + 1))]
    outputs = llm.embed(prompts, use_tqdm=False)
    _assert_embeddings(outputs, [_hf_embedding(hf_hidden(p), "LAST", True) for p in prompts])
    assert [o.prompt_token_ids for o in outputs] == prompts and all(o.finished for o in outputs)

    manager = llm.llm_engine.scheduler.kv_cache_manager
    sharing = PROMPTS[-1][:40] + [7, 8, 9]
    hits_before = manager.prefix_cache_hits
    (output,) = llm.embed(sharing, use_tqdm=False)
    assert manager.prefix_cache_hits > hits_before
    _assert_embeddings([output], [_hf_embedding(hf_hidden(sharing), "LAST", True)])
    assert manager.num_free_blocks == manager.num_usable_blocks  # every block freed

    raw = llm.encode(PROMPTS[:2], PoolingParams(normalize=False), use_tqdm=False)
    for output, prompt in zip(raw, PROMPTS[:2]):
        assert isinstance(output.outputs.data, np.ndarray)
        want = _hf_embedding(hf_hidden(prompt), "LAST", False)
        np.testing.assert_allclose(output.outputs.data, want, rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="dimensions"):  # not a matryoshka model
        llm.embed(PROMPTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_cls_pooling_matches_hf_with_chunked_prefill(model_dir, hf_hidden):
    """CLS takes the first chunk's first token; the prefix cache is off (a hit would skip it)."""
    llm = LLM(model_dir, runner="pooling", pooler_config=PoolerConfig("CLS", True), **CHUNKED)
    assert not llm.llm_engine.scheduler.kv_cache_manager.enable_prefix_caching
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    _assert_embeddings(outputs, [_hf_embedding(hf_hidden(p), "CLS", True) for p in PROMPTS])


def test_sentence_transformers_layout_picks_mean_without_normalizing(
    model_dir, hf_hidden, tmp_path
):
    """modules.json with a MEAN Pooling module and no Normalize one: the mean over every chunk
    of each prompt, unnormalized, with prompts preempted mid-prompt (a KV cache of 5 blocks)
    and recomputed; the config's matryoshka sizes allow `dimensions`, cut before normalizing."""
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling")])
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    pooling = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    config = json.loads((tmp_path / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 64]
    (tmp_path / "config.json").write_text(json.dumps(config))

    small = {"num_gpu_blocks_override": 6, "long_prefill_token_threshold": 4}
    llm = LLM(str(tmp_path), task="embed", **CHUNKED, **small)
    outputs = llm.embed(CROWDED, use_tqdm=False)
    _assert_embeddings(outputs, [_hf_embedding(hf_hidden(p), "MEAN", False) for p in CROWDED])
    assert llm.llm_engine.scheduler.num_preemptions_total > 0

    cut = llm.embed(PROMPTS, PoolingParams(dimensions=16, normalize=True), use_tqdm=False)
    _assert_embeddings(cut, [_hf_embedding(hf_hidden(p), "MEAN", True, 16) for p in PROMPTS])
    with pytest.raises(ValueError, match="allowed: \\[16, 64\\]"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=32), use_tqdm=False)


def test_runner_options_are_checked(model_dir):
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(model_dir, runner="embed")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(model_dir, runner="pooling", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(model_dir, runner="pooling", num_scheduler_steps=4)
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed(PROMPTS[0], use_tqdm=False)


def test_check_request_refuses_what_add_request_would(model_dir):
    """A data-parallel front end checks a request for a rank in another process with
    check_request (engine/process_data_parallel.py): what the rank would refuse must raise
    there, or the request is lost with no output and no error."""
    engine = LLM(model_dir, runner="pooling", **CHUNKED).llm_engine
    too_long = {"prompt_token_ids": list(range(1, MAX_MODEL_LEN + 2))}
    for prompt, params in [
        (too_long, PoolingParams()),
        ({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=8)),  # not matryoshka
        ({"prompt_token_ids": [1, 2]}, SamplingParams()),
    ]:
        with pytest.raises(ValueError):
            engine.add_request("a", prompt, params)
        with pytest.raises(ValueError):
            engine.check_request("a", prompt, params)
    with pytest.raises(TypeError):
        engine.check_request(7, {"prompt_token_ids": [1, 2]}, PoolingParams())
    assert not engine.has_unfinished_requests()
