"""Speculative decoding with an EAGLE-1 head (speculative_config method "eagle"), a checkpoint
of random weights in the published layout (benchmarks/random_heads.py): its drafts equal an
independent NumPy EAGLE-1 over HF's final hidden states of the target and the target's own LM
head, and greedy requests get exactly the tokens they get without speculation.
"""

import numpy as np
import pytest
import test_spec_decode_eagle as eagle3_tests
import torch
import transformers
from family_parity import TINY_SHAPES
from test_spec_decode_eagle import _rms, _rope, proposals_after_each_step

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.random_heads import save_random_eagle1_head
from jvllm.model_loader.hf_config import model_config_from_hf

ENGINE_KWARGS, PROMPTS = eagle3_tests.ENGINE_KWARGS, eagle3_tests.PROMPTS
looping_model_dir, plain_llm = eagle3_tests.looping_model_dir, eagle3_tests.plain_llm


def eagle(path: str, k: int = 3) -> dict:
    return {"method": "eagle", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("eagle1_head"))
    target = model_config_from_hf({**TINY_SHAPES, "architectures": ["LlamaForCausalLM"]}, "float32")
    return path, save_random_eagle1_head(path, target, seed=7)


def reference_drafts(model, tensors: dict, sequence: list[int], num_drafts: int) -> list[int]:
    """EAGLE-1 in NumPy over the whole `sequence`: HF's target gives its final (normed) hidden
    states and next token; fc over (the next token's embedding, the row), one layer without an
    input norm, the target's LM head over its output, which the next step reads."""
    w = {name: np.asarray(t, np.float64) for name, t in tensors.items()}
    n, k = TINY_SHAPES["num_attention_heads"], TINY_SHAPES["num_key_value_heads"]
    embedding = model.model.embed_tokens.weight.detach().double().numpy()
    lm_head = model.lm_head.weight.detach().double().numpy()
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_hidden_states=True)
    rows = out.hidden_states[-1][0].double().numpy()
    keys, values = [], []

    def step(tokens, hidden, positions):
        m = "layers.0."
        x = np.concatenate([embedding[tokens], hidden], axis=-1) @ w["fc.weight"].T + w["fc.bias"]
        q = (x @ w[m + "self_attn.q_proj.weight"].T).reshape(len(tokens), n, -1)
        key = (x @ w[m + "self_attn.k_proj.weight"].T).reshape(len(tokens), k, -1)
        value = (x @ w[m + "self_attn.v_proj.weight"].T).reshape(len(tokens), k, -1)
        q, key = _rope(q, positions), _rope(key, positions)
        keys.extend(key)
        values.extend(value)
        all_k = np.repeat(np.stack(keys), n // k, axis=1)
        all_v = np.repeat(np.stack(values), n // k, axis=1)
        scores = np.einsum("tnh,pnh->tnp", q, all_k) / np.sqrt(q.shape[-1])
        scores = np.where(
            np.arange(len(all_k))[None, None] <= positions[:, None, None], scores, -1e30
        )
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = (
            x
            + np.einsum("tnp,pnh->tnh", probs, all_v).reshape(len(tokens), -1)
            @ w[m + "self_attn.o_proj.weight"].T
        )
        y = _rms(x, w[m + "post_attention_layernorm.weight"])
        gate, up = y @ w[m + "mlp.gate_proj.weight"].T, y @ w[m + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[m + "mlp.down_proj.weight"].T
        return np.argmax(x @ lm_head.T, axis=-1), x

    next_token = int(out.logits[0, -1].argmax())
    drafts, row = step(np.asarray([*sequence[1:], next_token]), rows, np.arange(len(sequence)))
    tokens, row = [int(drafts[-1])], row[-1:]
    for i in range(num_drafts - 1):
        draft, row = step(np.asarray(tokens[-1:]), row, np.asarray([len(sequence) + i]))
        tokens.append(int(draft[0]))
    return tokens


def test_eagle_drafts_equal_a_reference_head_over_hf_hidden_states(looping_model_dir, head):
    """After a prefill and after each verification: the head's KV over the sequence, fc's
    bias, its layer without an input norm, the target's LM head over its output, its output
    carried through k - 1 more steps."""
    path, tensors = head
    llm = LLM(looping_model_dir, speculative_config=eagle(path, k=4), **ENGINE_KWARGS)
    model = transformers.AutoModelForCausalLM.from_pretrained(looping_model_dir).float().eval()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    steps = proposals_after_each_step(llm.llm_engine, "r", PROMPTS[3], params)
    num_checked = 0
    for sequence, _, drafts in steps:
        assert drafts == reference_drafts(model, tensors, sequence, 4)
        num_checked += 1
    assert num_checked >= 3


@pytest.mark.slow
def test_eagle_gives_the_tokens_of_no_speculation(looping_model_dir, plain_llm, head):
    llm = LLM(looping_model_dir, speculative_config=eagle(head[0]), **ENGINE_KWARGS)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = lambda engine: [
        list(o.outputs[0].token_ids) for o in engine.generate(PROMPTS, params, use_tqdm=False)
    ]
    assert tokens(llm) == tokens(plain_llm)
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 20


def test_an_eagle_head_served_as_the_engines_model_names_method_eagle(head):
    """A head whose config.json names vLLM's EagleLlamaForCausalLM is refused as an engine's
    model with the method that serves it, not EAGLE-3's."""
    overrides = {"architectures": ["EagleLlamaForCausalLM"]}
    with pytest.raises(ValueError, match="draft head .* speculative_config=.*'method': 'eagle',"):
        LLM(head[0], hf_overrides=overrides, **ENGINE_KWARGS)
