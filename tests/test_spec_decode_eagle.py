"""Speculative decoding with an EAGLE-3 head (speculative_config method "eagle3"), a checkpoint
of random weights in the published layout (benchmarks/random_heads.py): its drafts equal an
independent NumPy EAGLE-3 over HF's hidden states of the target, and greedy and seeded requests
get exactly the tokens they get without speculation.
"""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_spec_decode as ngram_tests
import torch
import transformers
from family_parity import TINY_SHAPES, save_random_model

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.random_heads import save_random_eagle3_head
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.model_loader.safetensors_file import read_safetensors
from jvllm.sample.plan import SamplerPlan
from jvllm.worker.draft_model import propose
from jvllm.worker.draft_positions import (
    choose_drafts,
    decode_after,
    last_kept_and_next_tokens,
)

ENGINE_KWARGS, PROMPTS = ngram_tests.ENGINE_KWARGS, ngram_tests.PROMPTS
looping_model_dir, plain_llm = ngram_tests.looping_model_dir, ngram_tests.plain_llm
EPS, THETA = 1e-6, 10000.0


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _rope(x, positions):  # x [T, heads, H], rotate-half
    h = x.shape[-1]
    inv = 1.0 / THETA ** (np.arange(0, h, 2) / h)
    angles = positions[:, None] * inv[None]  # [T, H/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class ReferenceHead:
    """EAGLE-3's head in NumPy, over whole positions with its own K/V lists."""

    def __init__(self, tensors: dict, embedding: np.ndarray):
        self.w = {name: np.asarray(t, np.float64) for name, t in tensors.items()}
        self.embedding = np.asarray(embedding, np.float64)
        self.keys, self.values = [], []

    def step(self, tokens, hidden, positions):
        """The next tokens i32[t], hidden rows [t, D] at `positions` -> (drafts, pre-norm)."""
        w, m = self.w, "midlayer."
        n, k = TINY_SHAPES["num_attention_heads"], TINY_SHAPES["num_key_value_heads"]
        x = np.concatenate(
            [
                _rms(self.embedding[tokens], w[m + "input_layernorm.weight"]),
                _rms(hidden, w[m + "hidden_norm.weight"]),
            ],
            axis=-1,
        )
        q = (x @ w[m + "self_attn.q_proj.weight"].T).reshape(len(tokens), n, -1)
        key = (x @ w[m + "self_attn.k_proj.weight"].T).reshape(len(tokens), k, -1)
        value = (x @ w[m + "self_attn.v_proj.weight"].T).reshape(len(tokens), k, -1)
        q, key = _rope(q, positions), _rope(key, positions)
        self.keys.extend(key)
        self.values.extend(value)
        keys, values = np.stack(self.keys), np.stack(self.values)  # [P, K, H]
        keys, values = np.repeat(keys, n // k, axis=1), np.repeat(values, n // k, axis=1)
        scores = np.einsum("tnh,pnh->tnp", q, keys) / np.sqrt(q.shape[-1])
        scores = np.where(
            np.arange(len(keys))[None, None] <= positions[:, None, None], scores, -1e30
        )
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("tnp,pnh->tnh", probs, values).reshape(len(tokens), -1)
        residual = hidden + attn @ w[m + "self_attn.o_proj.weight"].T
        y = _rms(residual, w[m + "post_attention_layernorm.weight"])
        gate, up = y @ w[m + "mlp.gate_proj.weight"].T, y @ w[m + "mlp.up_proj.weight"].T
        prenorm = residual + (gate / (1 + np.exp(-gate)) * up) @ w[m + "mlp.down_proj.weight"].T
        draft_ids = np.argmax(_rms(prenorm, w["norm.weight"]) @ w["lm_head.weight"].T, axis=-1)
        return (draft_ids + w["d2t"][draft_ids]).astype(int), prenorm


def reference_drafts(target_dir, tensors, layer_ids, prompt, num_drafts) -> list[int]:
    """The head's drafts after a greedy prefill of `prompt`: HF's target gives the rows entering
    `layer_ids` and the next token; the head runs over the prompt's positions, then drafts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    rows = np.concatenate([out.hidden_states[i][0].double().numpy() for i in layer_ids], -1)
    next_token = int(out.logits[0, -1].argmax())
    head = ReferenceHead(tensors, model.model.embed_tokens.weight.detach().numpy())
    hidden = rows @ head.w["fc.weight"].T
    positions = np.arange(len(prompt))
    drafts, prenorm = head.step(np.asarray([*prompt[1:], next_token]), hidden, positions)
    tokens, row = [int(drafts[-1])], prenorm[-1:]
    for i in range(num_drafts - 1):
        draft, row = head.step(np.asarray(tokens[-1:]), row, np.asarray([len(prompt) + i]))
        tokens.append(int(draft[0]))
    return tokens


def proposals_after_each_step(engine, request_id: str, prompt: list[int], params):
    """Runs a request of `prompt` alone to its end; after each step (a prefill chunk or a
    verification) that left it drafts, yields (the tokens computed so far, the next token,
    which is not yet, the drafts proposed after it)."""
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outputs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = list(out.outputs[0].token_ids)
        proposal = engine.scheduler.drafter._proposals.get(request_id)
        if proposal is not None:
            yield [*prompt, *outputs[:-1]], outputs[-1], proposal[1]


def drafts_after_prefill(llm: LLM, prompt: list[int]) -> list[int]:
    """The drafts proposed for a greedy request of `prompt` after its prefill step (which is
    then aborted, leaving the engine idle)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("probe", {"prompt_token_ids": prompt}, params)
    engine.step()
    _, drafts = engine.scheduler.drafter._proposals["probe"]
    engine.abort_request("probe")
    return drafts


def eagle3(path: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("eagle3_head"))
    target = model_config_from_hf({**TINY_SHAPES, "architectures": ["LlamaForCausalLM"]}, "float32")
    tensors = save_random_eagle3_head(
        path, target, draft_vocab_size=200, layer_ids=(0, 1, 1), seed=5
    )
    return path, tensors


def test_eagle3_drafts_equal_a_reference_head_over_hf_hidden_states(looping_model_dir, head):
    """After a prefill, and after each step that verified drafts, the drafts proposed for the
    next step are the NumPy head's over the whole sequence so far: the target's rows entering
    layers 0, 1, 1, the tokens shifted by one, the head's KV (its rows at rejected drafts'
    positions recomputed), its pre-norm row carried through k - 1 more steps, and d2t's map."""
    path, tensors = head
    llm = LLM(looping_model_dir, speculative_config=eagle3(path, k=4), **ENGINE_KWARGS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate([PROMPTS[0], PROMPTS[3]]):
        num_checked = 0
        for sequence, _, drafts in proposals_after_each_step(engine, f"r{i}", prompt, params):
            assert drafts == reference_drafts(looping_model_dir, tensors, (0, 1, 1), sequence, 4)
            num_checked += 1
        assert num_checked >= 3


@pytest.mark.parametrize(
    "num_blocks", [None, pytest.param(14, marks=pytest.mark.slow, id="preempting")]
)
def test_eagle3_gives_the_tokens_of_no_speculation(num_blocks, looping_model_dir, plain_llm, head):
    """Greedy requests (chunked prefill: the 45-token prompt takes two steps beside others),
    then a seeded sampled one beside them; also in a KV cache small enough to preempt (a
    resumed request's head KV is recomputed with its target's)."""
    llm = LLM(
        looping_model_dir,
        speculative_config=eagle3(head[0]),
        num_gpu_blocks_override=num_blocks,
        **ENGINE_KWARGS,
    )
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.2, top_k=50, seed=11, max_tokens=24, ignore_eos=True)
    prompts, params = [*PROMPTS, PROMPTS[1]], [greedy] * len(PROMPTS) + [seeded]
    tokens = lambda engine: [
        list(o.outputs[0].token_ids) for o in engine.generate(prompts, params, use_tqdm=False)
    ]
    assert tokens(llm) == tokens(plain_llm)
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 20
    if num_blocks is not None:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_the_head_reads_the_token_after_each_position_and_drafts_after_the_kept_ones():
    """A step of a verification (t, d1, d2, d3 whose target tokens accept d1 and d2), a prompt
    chunk short of its prompt's end, and a padding row: the head's input token at each position
    is the target's there (d1, d2, the correction, the bonus), the chunk's own next ones and
    the prompt's next; its drafts start after the last accepted draft and the chunk's end."""
    md = SimpleNamespace(
        seq_lens=jnp.asarray([13, 9, 0]),
        logits_indices=jnp.asarray([3, 6, 6]),  # padding points at the last real token
        query_start_loc=jnp.asarray([0, 4, 7, 7]),
    )
    drafts = SimpleNamespace(
        indices=jnp.asarray([0, 1, 2, 0]),
        seq_index=jnp.asarray([0, 0, 0, 0]),
        num_tokens_before=jnp.asarray([3, 2, 1, 0]),  # the last entry is padding
        next_token_ids=jnp.asarray([-1, 42, -1]),
    )
    inputs = SimpleNamespace(
        token_ids=jnp.asarray([7, 10, 11, 12, 20, 21, 22, 0]), attn=md, drafts=drafts
    )
    sampled, targets = jnp.asarray([55, 66, 77]), jnp.asarray([10, 11, 99, 0])
    last_kept, next_tokens = last_kept_and_next_tokens(inputs, sampled, targets)
    assert last_kept[:2].tolist() == [2, 6]
    assert next_tokens[:7].tolist() == [10, 11, 99, 55, 21, 22, 42]


def test_an_eagle3_head_is_refused_as_the_engines_model_and_a_model_as_a_head(
    looping_model_dir, head
):
    with pytest.raises(
        ValueError, match="is a draft head .* speculative_config=.*'method': 'eagle3',"
    ):
        LLM(head[0], **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        LLM(looping_model_dir, speculative_config=eagle3(looping_model_dir), **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="method 'eagle3' needs model"):
        LLM(looping_model_dir, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


@pytest.mark.slow
def test_eagle3_after_a_sleep_gives_the_tokens_it_gave_before(looping_model_dir, head):
    """Level 1 sleep drops the target's and the head's KV and moves both models' weights to
    host memory; after wake_up the head drafts over its zeroed cache as it did the first time.
    Level 2 keeps the head's weights in host memory too (nothing else would bring them back)."""
    llm = LLM(
        looping_model_dir,
        speculative_config=eagle3(head[0]),
        enable_sleep_mode=True,
        **ENGINE_KWARGS,
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    generate = lambda: [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)
    ]
    stats = llm.llm_engine.spec_decoding_stats
    before, drafts = generate(), stats.num_draft_tokens
    draft = llm.llm_engine.model_runner.draft
    for level in (1, 2):
        head_arrays = jax.tree.leaves(draft.params)
        llm.sleep(level=level)
        assert all(a.is_deleted() for a in head_arrays)
        if level == 2:  # the target's weights come back through load_weights
            llm.load_weights(read_safetensors(f"{looping_model_dir}/model.safetensors").items())
        llm.wake_up()
        assert generate() == before
    assert stats.num_draft_tokens == 3 * drafts


def test_a_published_heads_t2d_loads_without_a_warning(head, monkeypatch):
    """EAGLE-3 heads ship t2d (the draft vocabulary's mask over the target's, d2t's inverse),
    which drafting never needs, as vLLM skips it: no warning that outputs may differ."""
    from jvllm.model_loader import hf

    warned = []
    monkeypatch.setattr(hf.logger, "warning", lambda *args: warned.append(args[0] % args[1:]))
    hf.load_hf_dir(head[0], "float32")
    assert warned == []


def test_a_head_made_for_a_target_of_another_width_is_refused(looping_model_dir, tmp_path):
    """A head of the target's vocabulary but another width (an 8B model's head beside a 70B
    target) is refused when the engine is built, naming both widths, not by every step."""
    other = model_config_from_hf(
        {**TINY_SHAPES, "hidden_size": 128, "architectures": ["LlamaForCausalLM"]}, "float32"
    )
    save_random_eagle3_head(str(tmp_path), other, draft_vocab_size=200, layer_ids=(0, 1, 1))
    with pytest.raises(ValueError, match="hidden size 128, the target's is 64"):
        LLM(looping_model_dir, speculative_config=eagle3(str(tmp_path)), **ENGINE_KWARGS)


def test_a_target_whose_layers_hide_their_inputs_is_refused_when_built(tmp_path):
    """GPT-2's layers do not run through layers/rotary_layers.py, so they expose no inputs to
    an EAGLE-3 head: the engine is refused when it is built, not every request at its step."""
    target = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256, eos_token_id=2
    )
    save_random_model(tmp_path / "gpt2", target)
    config = model_config_from_hf(
        {**target.to_dict(), "architectures": ["GPT2LMHeadModel"]}, "float32"
    )
    (tmp_path / "head").mkdir()
    save_random_eagle3_head(
        str(tmp_path / "head"), config, draft_vocab_size=200, layer_ids=(0, 1, 1)
    )
    with pytest.raises(ValueError, match="do not expose their inputs"):
        LLM(
            str(tmp_path / "gpt2"),
            speculative_config=eagle3(str(tmp_path / "head")),
            **ENGINE_KWARGS,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Sampling:
    output_index: jax.Array  # all that advance_inputs reads of the sampling metadata


def test_the_draft_loops_stop_a_row_at_its_tables_end():
    """A sequence two positions short of its table's end (a request at max_model_len) drafts
    4 steps: its first two write their slots, the others nothing (a page looked up past the
    table would be a wrapped id, landing on another sequence's slots)."""
    block_size, table = 4, jnp.asarray([[3, 5]])  # positions 0..7 of the pages 3 and 5
    md = SimpleNamespace(seq_lens=jnp.asarray([6]), logits_indices=jnp.asarray([0]))
    drafts = SimpleNamespace(next_token_ids=jnp.asarray([-1]))
    md.block_tables = table
    inputs = SimpleNamespace(
        positions=jnp.asarray([5]), attn=md, drafts=drafts, sampling=_Sampling(jnp.asarray([0]))
    )
    step_inputs = decode_after(inputs, jnp.asarray([0]), jnp.asarray([9]), block_size)

    def forward(params, kv, token_ids, positions, md, mm):
        return jnp.zeros((1, 8)), kv.at[md.slot_mapping].add(1)

    model = SimpleNamespace(forward=forward, logits=lambda params, hidden: jnp.zeros((1, 16)))
    active = step_inputs.attn.seq_lens > 0
    choose = functools.partial(choose_drafts, plan=SamplerPlan.GREEDY, bias_rows=None, history=None)
    _, kv = propose(
        None, jnp.zeros(8 * block_size), step_inputs, active, jnp.asarray([1]),
        model=model, num_steps=4, block_size=block_size, choose=choose,
    )  # fmt: skip
    written = np.flatnonzero(np.asarray(kv)[1:]) + 1  # slot 0: the null page
    assert written.tolist() == [5 * block_size + 2, 5 * block_size + 3]


def test_a_draft_steps_reading_tiles_come_first():
    """Rows that sample after rows that do not (prompt chunks short of their end, padding): the
    draft's decode step puts the sampled rows' tiles first, as the pure-JAX page walk reads
    only the leading tiles that read (attention/reference.py)."""
    num_seqs = 40
    sampled_rows = [33, 36, 39]
    seq_lens = jnp.zeros(num_seqs, jnp.int32).at[jnp.asarray(sampled_rows)].set(9)
    md = SimpleNamespace(seq_lens=seq_lens, block_tables=jnp.ones((num_seqs, 4), jnp.int32))
    next_ids = jnp.full(num_seqs, -1, jnp.int32).at[:30].set(5)  # 30 chunks short of their end
    inputs = SimpleNamespace(
        positions=jnp.full(num_seqs, 8, jnp.int32),
        attn=md,
        drafts=SimpleNamespace(next_token_ids=next_ids),
        sampling=None,
    )
    rows = jnp.arange(num_seqs)
    step = decode_after(inputs, rows, jnp.zeros(num_seqs, jnp.int32), block_size=4)
    (tiles,) = step.attn.tiles
    assert tiles.seq[:3].tolist() == sampled_rows
    assert tiles.token_idx[:3, 0].tolist() == sampled_rows
    assert tiles.kv_lens[:3, 0].tolist() == [10, 10, 10]
    assert not tiles.kv_lens[3:].any()
