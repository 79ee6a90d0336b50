"""Rounds of speculative decoding chained on the device: a decode window with drafts.

With a draft model or head and `num_scheduler_steps` = R, a decode window runs up to R rounds in
one call. A round is the engine's step over each row's last token and k drafts: the target
verifies the drafts (draft_scoring.py), and the step's draft proposes the next k from the last
kept position (worker/draft_model.py, worker/eagle.py). The row goes on from its run, the
target's tokens t0..ta at the a accepted drafts and the one after them, and stops on the device
at a stop token id inside the run or at its limit (decode_loop.WindowInputs) as a decode
window's row does; the run's tokens past a stop or the limit are dropped. Nothing returns to the
host between rounds: no engine we know of speculates inside a multi-step device loop.

The host lays out the first round (step_inputs.py: every request's k + 1 tokens, in order); the
device lays out the others uniformly, row s's tokens at s(k + 1) .. s(k + 1) + k, each its own
one-query attention tile reading the positions before the round from the pages and the round's
own from k, v (attention/window.py). A row that has stopped reads and writes the null page
alone: its block table is zeroed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention.metadata import Tiles
from jvllm.core.request import Request
from jvllm.spec_decode.ngram_device import RowTokens, propose_ngram_on_device
from jvllm.worker.decode_loop import DecodeCarry, WindowInputs
from jvllm.worker.draft_positions import in_table
from jvllm.worker.runner_output import ModelRunnerOutput
from jvllm.worker.step_inputs import StepInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecWindowOutput:
    """A window's rounds, round-major; a row's entries past its last round are zeros."""

    runs: jax.Array  # i32[R, S, k + 1] each round's t0..tk, of which the row took num_taken
    num_taken: jax.Array  # i32[R, S] the tokens each row took in each round (0: stopped)
    num_accepted: jax.Array  # i32[R, S] the drafts the target accepted in each round
    # i32[R, S] the drafts each round verified that were proposals (the first round's: k, its
    # drafts the host's, padded; later: k from a model, n-gram's as many as it found)
    num_drafted: jax.Array
    draft_tokens: jax.Array  # i32[S, k] each row's proposals of the last round it took part in
    draft_counts: jax.Array  # i32[S] how many of them are proposals (the rest 0s)
    # Each run token's logprobs, as a step's: top ids i32[R, S, k + 1, K], top logprobs f32[...,
    # K], the token's logprob f32[R, S, k + 1] and rank i32[...] (zeros unless a row asked)
    logprobs: tuple[jax.Array, ...]
    # A model with routed experts: the rounds' expert counts summed, i32[L_moe, E]
    expert_counts: jax.Array | None = None


def round_runs(inputs: StepInputs, sampled: jax.Array, targets: jax.Array):
    """(runs i32[S, k + 1], num_accepted i32[S]) of a round laid out row by row: `sampled` i32[S]
    the step's samples (the bonus, tk), `targets` i32[S * k] its tokens at the scored positions
    (t0..t(k-1) of each row, in row order)."""
    num_seqs = sampled.shape[0]
    targets = targets.reshape(num_seqs, -1)  # [S, k]
    drafts = inputs.token_ids.reshape(num_seqs, -1)[:, 1:]  # [S, k] d1..dk
    num_accepted = jnp.sum(jnp.cumprod(drafts == targets, axis=1), axis=1)
    return jnp.concatenate([targets, sampled[:, None]], axis=1), num_accepted


def round_logprobs(step_out, num_seqs: int) -> tuple[jax.Array, ...]:
    """Each run token's logprobs [S, k + 1, ...] from a round's step: t0..t(k-1)'s at the scored
    positions (`draft_logprobs`, [S * k, ...] in row order), then the bonus's."""
    bonus = (
        step_out.topk_token_ids,
        step_out.topk_logprobs,
        step_out.sampled_logprobs,
        step_out.sampled_ranks,
    )
    return tuple(
        jnp.concatenate([scored.reshape(num_seqs, -1, *scored.shape[1:]), last[:, None]], axis=1)
        for scored, last in zip(step_out.draft_logprobs, bonus)
    )


def take_runs(window: WindowInputs, runs, num_accepted, num_sampled, active):
    """What each active row takes of its run t0..ta: up to and with its first stop token id, at
    most its limit less what it sampled -> (num_taken i32[S], num_sampled, active)."""
    width = runs.shape[1]
    j = jnp.arange(width)
    stops = jnp.any(runs[:, :, None] == window.stop_token_ids[:, None, :], axis=2)  # [S, k + 1]
    first_stop = jnp.min(jnp.where(stops & (j <= num_accepted[:, None]), j, width), axis=1)
    room = window.limits - num_sampled
    num_taken = jnp.where(active, jnp.minimum(jnp.minimum(num_accepted, first_stop) + 1, room), 0)
    num_sampled = num_sampled + num_taken
    active = active & (first_stop >= num_taken) & (num_sampled < window.limits)
    return num_taken, num_sampled, active


def next_positions(inputs: StepInputs, num_accepted, width: int) -> jax.Array:
    """i32[S] each row's next position, that of its run's last token ta: its last position this
    round less k, on by the a drafts it accepted and one."""
    return inputs.positions[inputs.attn.logits_indices] - (width - 1) + num_accepted + 1


def ngram_drafts(
    token_cache, inputs: StepInputs, runs, num_accepted, prompt_lookup: tuple[int, int]
) -> tuple[jax.Array, jax.Array]:
    """n-gram drafts for the next round -> (i32[S, k], counts i32[S]): each row's tokens read
    from the token cache through its block table up to its next position, where its run's last
    token ta stands (not yet written), looked up as the host looks them up (ngram.py)."""
    num_seqs, width = runs.shape
    last = next_positions(inputs, num_accepted, width)  # [S]
    run_end = runs[jnp.arange(num_seqs), num_accepted]  # [S] ta
    tokens = paged_tokens(token_cache, inputs.attn.block_tables, last, run_end)
    return propose_ngram_on_device(tokens, last + 1, *prompt_lookup, width - 1)


def paged_tokens(token_cache, tables, last, run_end) -> RowTokens:
    """Each row's tokens in the token cache [P, B] through its block table i32[S, M], with
    run_end i32[S] placed at position last i32[S] (by `at`: a span is read before it)."""
    num_seqs, block_size = tables.shape[0], token_cache.shape[1]
    rows = jnp.arange(num_seqs)[:, None]

    def at(positions):  # i32[S, C] -> i32[S, C]
        positions = jnp.clip(positions, 0, tables.shape[1] * block_size - 1)
        cached = token_cache[tables[rows, positions // block_size], positions % block_size]
        return jnp.where(positions == last[:, None], run_end[:, None], cached)

    def span(first, size):  # whole pages read, then cut: i32[S, size]
        count = -(-size // block_size) + 1
        page = jnp.floor_divide(first, block_size)
        pages = jnp.take(tables, page + jnp.arange(count), axis=1, mode="clip")  # [S, count]
        read = token_cache[pages].reshape(num_seqs, count * block_size)
        return jax.lax.dynamic_slice_in_dim(read, first - page * block_size, size, axis=1)

    return RowTokens(at, span)


def next_round_inputs(
    inputs: StepInputs, runs, num_accepted, drafts, active, block_size: int
) -> StepInputs:
    """The next round's inputs, laid out row by row: each active row's last run token ta at the
    position after its last kept one, then `drafts` i32[S, k] (the step's proposals); the
    others on the null page."""
    md = inputs.attn
    num_seqs, width = runs.shape
    rows = jnp.arange(num_seqs)
    first = jnp.where(active, next_positions(inputs, num_accepted, width), 0)  # [S]
    positions = first[:, None] + jnp.arange(width)  # [S, k + 1]
    tables = jnp.where(active[:, None], md.block_tables, 0)
    column = jnp.minimum(positions // block_size, tables.shape[1] - 1)
    pages = jnp.take_along_axis(tables, column, axis=1)
    slots = jnp.where(
        in_table(positions, tables, block_size), pages * block_size + positions % block_size, 0
    )
    tokens = jnp.concatenate([runs[rows, num_accepted][:, None], drafts], axis=1)
    # Each query its own tile, reading the positions before the round from the pages; the
    # active rows' tiles first, as the pure-JAX page walk reads only the leading tiles that
    # read (reference.py: the host packs them first).
    tile_rows = jnp.repeat(jnp.argsort(~active, stable=True), width)  # [S * (k + 1)]
    token_idx = tile_rows * width + jnp.tile(jnp.arange(width), num_seqs)
    attn = dataclasses.replace(
        md,
        image_groups=None if md.image_groups is None else jnp.full_like(md.image_groups, -1),
        slot_mapping=slots.reshape(-1),
        block_tables=tables,
        seq_lens=first + width,
        query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32) * width,
        logits_indices=rows * width + width - 1,
        tiles=(Tiles(token_idx[:, None], first[tile_rows][:, None], tile_rows),),
    )
    scored = (rows[:, None] * width + jnp.arange(width - 1)).reshape(-1)  # [S * k]
    scoring = dataclasses.replace(
        inputs.drafts,
        indices=scored,
        seq_index=scored // width,
        num_tokens_before=jnp.where(active[:, None], jnp.arange(width - 1, 0, -1), 0).reshape(-1),
        any_drafts=jnp.bool_(True),
    )
    sampling = dataclasses.replace(
        inputs.sampling, output_index=inputs.sampling.output_index + num_accepted + 1
    )
    return StepInputs(
        tokens.reshape(-1), positions.reshape(-1), attn, sampling, scoring, mm=inputs.mm
    )


def run_spec_window(
    params,
    kv_cache,
    token_cache,
    bias_rows,
    inputs: StepInputs,
    window: WindowInputs,
    *,
    step,
    num_rounds: int,
    num_drafts: int,
    max_logprobs: int,
    rounds_per_check: int = 1,
    expert_counts_shape: tuple[int, int] | None = None,
    prompt_lookup: tuple[int, int] | None = None,
    any_active=jnp.any,
) -> tuple[SpecWindowOutput, object, jax.Array]:
    """Up to `num_rounds` rounds of k = `num_drafts` drafts in one call, until every row has
    stopped -> (SpecWindowOutput, kv_cache, token_cache). `inputs`: the first round, each row's
    last token and k drafts; `step`: the engine's step body with its draft (step_fn.model_step).
    Whether a row is still active is checked after each `rounds_per_check` rounds, as a decode
    window checks (decode_loop.run_window: on a GPU each check waits for the host); the rounds
    of a run past `num_rounds` keep every row stopped. `prompt_lookup`: n-gram drafts'
    (min_n, max_n), looked up on the device after each round (`ngram_drafts`); None: the
    step's draft model or head proposes them. `any_active` as decode_loop.run_window takes it
    (a group of ranks goes on while any rank's row is active)."""
    num_seqs, width = window.limits.shape[0], num_drafts + 1
    block_size, k = token_cache.shape[1], max(max_logprobs, 1)
    zeros = jnp.zeros((num_rounds, num_seqs), jnp.int32)
    per_token = (num_rounds, num_seqs, width)
    out = SpecWindowOutput(
        runs=jnp.zeros(per_token, jnp.int32),
        num_taken=zeros,
        num_accepted=zeros,
        num_drafted=zeros,
        draft_tokens=jnp.zeros((num_seqs, num_drafts), jnp.int32),
        draft_counts=jnp.full((num_seqs,), num_drafts, jnp.int32),
        logprobs=(
            jnp.zeros((*per_token, k), jnp.int32),
            jnp.zeros((*per_token, k), jnp.float32),
            jnp.zeros(per_token, jnp.float32),
            jnp.zeros(per_token, jnp.int32),
        ),
        expert_counts=None
        if expert_counts_shape is None
        else jnp.zeros(expert_counts_shape, jnp.int32),
    )
    carry = DecodeCarry(
        kv_cache, token_cache, inputs, jnp.zeros(num_seqs, jnp.int32), window.limits > 0
    )

    def one_round(state):
        r, carry, out = state
        carry = dataclasses.replace(carry, active=carry.active & (r < num_rounds))
        # Through a barrier with the carry, as decode_loop.decode_step says why.
        params_r, carry = jax.lax.optimization_barrier((params, carry))
        step_out, _, kv, tokens = step(
            params_r, carry.kv_cache, carry.token_cache, bias_rows, carry.inputs
        )
        runs, num_accepted = round_runs(
            carry.inputs, step_out.sampled_token_ids, step_out.draft_target_ids
        )
        num_taken, num_sampled, active = take_runs(
            window, runs, num_accepted, carry.num_sampled, carry.active
        )
        if prompt_lookup is None:
            drafts, counts = step_out.draft_tokens, out.draft_counts
        else:
            drafts, counts = ngram_drafts(tokens, carry.inputs, runs, num_accepted, prompt_lookup)
        next_inputs = next_round_inputs(
            carry.inputs, runs, num_accepted, drafts, active, block_size
        )
        put = lambda rows, value: rows.at[r].set(value, mode="drop")  # past num_rounds: none
        out = SpecWindowOutput(
            runs=put(out.runs, runs),
            num_taken=put(out.num_taken, num_taken),
            num_accepted=put(out.num_accepted, jnp.where(carry.active, num_accepted, 0)),
            num_drafted=put(out.num_drafted, jnp.where(carry.active, out.draft_counts, 0)),
            # A row's drafts are its last round's: those of rounds it sat out are over the
            # null page.
            draft_tokens=jnp.where(carry.active[:, None], drafts, out.draft_tokens),
            draft_counts=jnp.where(carry.active, counts, out.draft_counts),
            logprobs=tuple(
                put(rows, lp) for rows, lp in zip(out.logprobs, round_logprobs(step_out, num_seqs))
            ),
            # A stopped row writes the null page, which counts nothing (models/model.py).
            expert_counts=None
            if out.expert_counts is None
            else out.expert_counts + step_out.expert_counts,
        )
        return r + 1, DecodeCarry(kv, tokens, next_inputs, num_sampled, active), out

    def keep_going(state):
        r, carry, _ = state
        return (r < num_rounds) & any_active(carry.active)

    def rounds(state):
        if rounds_per_check == 1:
            return one_round(state)
        return jax.lax.fori_loop(0, rounds_per_check, lambda _, s: one_round(s), state)

    _, carry, out = jax.lax.while_loop(keep_going, rounds, (jnp.int32(0), carry, out))
    return out, carry.kv_cache, carry.token_cache


def first_round(
    drafts: list[list[int]] | None, num_reqs: int, num_drafts: int
) -> tuple[list[list[int]], list[int]]:
    """A window's first round from the scheduler's drafts (each request's own, up to k; None:
    none) -> (k drafts each, token 0 past a request's own: any draft is exact to verify; each
    request's k + 1 scheduled tokens)."""
    drafts = drafts or [[]] * num_reqs
    return [d + [0] * (num_drafts - len(d)) for d in drafts], [1 + num_drafts] * num_reqs


def fetch_spec_window(
    out: SpecWindowOutput, num_reqs: int, any_logprobs: bool
) -> ModelRunnerOutput:
    """Wait for a window's rounds -> each request's tokens in order, the drafts the target
    accepted in each round it took part in, and where any request asked, the tokens' logprobs
    shaped as a decode window's ([n, num_reqs, ...]: token j of request i at [j, i])."""
    taken = np.asarray(out.num_taken)[:, :num_reqs]  # [R, num_reqs]
    width = out.runs.shape[2]
    took = np.arange(width) < taken[:, :, None]  # [R, num_reqs, k + 1] the tokens taken
    runs = np.asarray(out.runs)[:, :num_reqs]
    tokens = [runs[:, i][took[:, i]].tolist() for i in range(num_reqs)]  # round by round
    accepted = np.asarray(out.num_accepted)[:, :num_reqs]
    drafted = np.asarray(out.num_drafted)[:, :num_reqs]
    round_drafts = [
        list(zip(drafted[taken[:, i] > 0, i].tolist(), accepted[taken[:, i] > 0, i].tolist()))
        for i in range(num_reqs)
    ]
    result = ModelRunnerOutput(tokens, round_drafts=round_drafts)
    if any_logprobs:
        num_steps = max(len(t) for t in tokens)
        rounds = np.zeros((num_steps, num_reqs), np.int64)
        spots = np.zeros((num_steps, num_reqs), np.int64)  # each token's place in its run
        for i, num_tokens in enumerate(map(len, tokens)):
            rounds[:num_tokens, i], spots[:num_tokens, i] = np.nonzero(took[:, i])
        rows = np.broadcast_to(np.arange(num_reqs), rounds.shape)
        result.logprobs = tuple(np.asarray(f)[rounds, rows, spots] for f in out.logprobs)
    return result


def cut_short(result: ModelRunnerOutput, requests: list[Request]) -> list[str]:
    """The requests whose last round's run the window cut at their limit (min_tokens' end) short
    of its accepted drafts and bonus: their draft proposed after the whole run, for output
    indices past the tokens they took."""
    runs = zip(requests, result.sampled_token_ids, result.round_drafts)
    return [
        r.request_id
        for r, tokens, rounds in runs
        if len(tokens) < sum(accepted + 1 for _, accepted in rounds)
    ]
