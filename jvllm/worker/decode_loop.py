"""Decode steps chained on the device: each sampled token is the next step's input.

The engine's decode window (`num_scheduler_steps`) and the public step loop (jvllm/step_loop.py)
both run `decode_step` over a `DecodeCarry`. A row decodes while it is active; it stops, on the
device, after sampling one of its stop token ids or its limit of tokens, and from then on writes
only the null page (slot 0) and its samples are ignored.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention.kv_quant import KVCache
from jvllm.core.decode_window import MAX_WINDOW_STOP_IDS, window_stop_token_ids
from jvllm.core.request import Request
from jvllm.sample.metadata import SamplerOutput
from jvllm.worker.step_inputs import StepInputs

# Decode steps a window runs between its checks that some row still decodes (run_window);
# unset: 1, a check after every step.
WINDOW_STEPS_PER_CHECK_ENV = "JVLLM_WINDOW_STEPS_PER_CHECK"


def window_steps_per_check() -> int:
    """The setting of WINDOW_STEPS_PER_CHECK_ENV, an int >= 1."""
    setting = os.environ.get(WINDOW_STEPS_PER_CHECK_ENV, "1")
    if not setting.isdigit() or int(setting) < 1:
        raise ValueError(
            f"{WINDOW_STEPS_PER_CHECK_ENV}={setting!r}; allowed: an integer >= 1 (or unset: 1)"
        )
    return int(setting)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowInputs:
    """Per-row stops of a decode window, one row per sequence of the decode bucket."""

    limits: jax.Array  # i32[S] the most tokens each row samples; 0 = a padding row
    stop_token_ids: jax.Array  # i32[S, W] ids that end the row; pad -1


def prepare_window_inputs(
    requests: list[Request], limits: list[int], num_seqs: int
) -> WindowInputs:
    stop_ids = np.full((num_seqs, MAX_WINDOW_STOP_IDS), -1, np.int32)
    for s, request in enumerate(requests):
        ids = window_stop_token_ids(request)
        stop_ids[s, : len(ids)] = ids
    padded_limits = np.zeros(num_seqs, np.int32)
    padded_limits[: len(limits)] = limits
    return WindowInputs(padded_limits, stop_ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCarry:
    """What changes from one decode step to the next."""

    kv_cache: KVCache  # [L, V, K, P, B, H] (and a quantized cache's scales)
    token_cache: jax.Array  # i32[P, B]
    inputs: StepInputs  # the next step's inputs (a decode bucket: T = S)
    num_sampled: jax.Array  # i32[S] tokens each row sampled so far
    active: jax.Array  # bool[S] rows still decoding


def advance_inputs(
    inputs: StepInputs, sampled: jax.Array, active: jax.Array, block_size: int
) -> StepInputs:
    """The next decode step's inputs: each active row's sampled token i32[S] at its next
    position, written at that position's slot; inactive rows write the null page."""
    md = inputs.attn
    positions = inputs.positions + active  # [S]
    pages = jnp.take_along_axis(md.block_tables, (positions // block_size)[:, None], axis=1)[:, 0]
    slot_mapping = jnp.where(active, pages * block_size + positions % block_size, 0)
    kv_groups = md.kv_groups
    if kv_groups is not None:  # every group's slots [G, S] the same way
        column = (positions // block_size)[None, :, None]
        pages = jnp.take_along_axis(kv_groups.block_tables, column, axis=2)[..., 0]
        kv_groups = dataclasses.replace(
            kv_groups,
            slot_mapping=jnp.where(active, pages * block_size + positions % block_size, 0),
        )
    (tiles,) = md.tiles  # one-query tiles; padding tiles read nothing and stay so
    grows = active[tiles.seq][:, None] & (tiles.kv_lens > 0)  # [NT, 1]
    attn = dataclasses.replace(
        md,
        image_groups=None if md.image_groups is None else jnp.full_like(md.image_groups, -1),
        slot_mapping=slot_mapping,
        kv_groups=kv_groups,
        seq_lens=md.seq_lens + active,
        tiles=(dataclasses.replace(tiles, kv_lens=tiles.kv_lens + grows),),
    )
    sampling = dataclasses.replace(
        inputs.sampling, output_index=inputs.sampling.output_index + active
    )
    mm = None if inputs.mm is None else inputs.mm.without_images()
    return StepInputs(sampled, positions, attn, sampling, mm=mm)


def decode_step(
    step, params, bias_rows, window: WindowInputs, carry: DecodeCarry, choose=None
) -> tuple[DecodeCarry, SamplerOutput, jax.Array, jax.Array]:
    """One decode step of every row, then the inputs of the next -> (carry, this step's
    SamplerOutput, its raw logits f32[S, V], the tokens taken i32[S]).

    `step` is the engine's jitted step body (step_fn.model_step with its statics bound);
    `choose(logits, sampler_output) -> i32[S]`, when given, takes the tokens instead of the
    engine's sample.
    The params pass an optimization barrier together with the carry, which makes them
    loop-variant to XLA: in a loop, XLA otherwise hoists each bfloat16 weight's conversion to
    float32 out of the loop, which runs the whole weights through memory as float32
    temporaries every step (SmolLM2 bfloat16 on CPU: 30x slower; BENCHMARKS.md)."""
    params, carry = jax.lax.optimization_barrier((params, carry))
    out, logits, kv_cache, token_cache = step(
        params, carry.kv_cache, carry.token_cache, bias_rows, carry.inputs
    )
    token_ids = out.sampled_token_ids if choose is None else choose(logits, out)
    carry = dataclasses.replace(carry, kv_cache=kv_cache, token_cache=token_cache)
    return feed_back(window, carry, token_ids), out, logits, token_ids


def feed_back(window: WindowInputs, carry: DecodeCarry, token_ids: jax.Array) -> DecodeCarry:
    """Count each active row's token i32[S], stop the rows it ends, and make it the next input."""
    num_sampled = carry.num_sampled + carry.active
    stopped = jnp.any(token_ids[:, None] == window.stop_token_ids, axis=1)
    active = carry.active & ~stopped & (num_sampled < window.limits)
    block_size = carry.token_cache.shape[1]
    inputs = advance_inputs(carry.inputs, token_ids, active, block_size)
    return dataclasses.replace(carry, inputs=inputs, num_sampled=num_sampled, active=active)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowOutput:
    """A window's samples, step-major; entries past a row's `num_sampled` are meaningless."""

    token_ids: jax.Array  # i32[k, S]
    num_sampled: jax.Array  # i32[S]
    topk_token_ids: jax.Array  # i32[k, S, K] (zeros unless some row asked for logprobs)
    topk_logprobs: jax.Array  # f32[k, S, K]
    sampled_logprobs: jax.Array  # f32[k, S]
    sampled_ranks: jax.Array  # i32[k, S]
    # A model with routed experts: the steps' expert counts summed (step_fn.py), i32[L_moe, E]
    expert_counts: jax.Array | None = None


def run_window(
    params,
    kv_cache,
    token_cache,
    bias_rows,
    inputs: StepInputs,
    window: WindowInputs,
    *,
    step,
    num_steps: int,
    steps_per_check: int,
    max_logprobs: int,
    expert_counts_shape: tuple[int, int] | None = None,
    any_active=jnp.any,
) -> tuple[WindowOutput, jax.Array, jax.Array]:
    """Up to `num_steps` decode steps in one call, until every row has stopped
    -> (WindowOutput, kv_cache, token_cache).

    Whether every row has stopped is checked after each `steps_per_check` steps (a loop of
    that fixed trip count inside the window's while loop): on a GPU, XLA reads a while loop's
    predicate on the host, which waits for the stream to drain, and a fixed trip count needs
    no predicate. A row that stops inside such a run of steps writes nothing more; the steps
    left after every row stopped are spent. `expert_counts_shape`: (L_moe, E) of a model with
    routed experts, whose steps' counts the window sums. `any_active`(bool[S]) -> whether the
    window goes on: any row still decodes (a group of ranks asks every rank's rows,
    worker/rank_group_step.py)."""
    num_seqs, k = window.limits.shape[0], max(max_logprobs, 1)
    steps_per_check = min(steps_per_check, num_steps)
    active = window.limits > 0
    carry = DecodeCarry(kv_cache, token_cache, inputs, jnp.zeros(num_seqs, jnp.int32), active)
    out = WindowOutput(
        token_ids=jnp.zeros((num_steps, num_seqs), jnp.int32),
        num_sampled=carry.num_sampled,
        topk_token_ids=jnp.zeros((num_steps, num_seqs, k), jnp.int32),
        topk_logprobs=jnp.zeros((num_steps, num_seqs, k), jnp.float32),
        sampled_logprobs=jnp.zeros((num_steps, num_seqs), jnp.float32),
        sampled_ranks=jnp.zeros((num_steps, num_seqs), jnp.int32),
        expert_counts=None
        if expert_counts_shape is None
        else jnp.zeros(expert_counts_shape, jnp.int32),
    )

    def one_step(j, state):
        carry, out = state
        carry, step_out, _, _ = decode_step(step, params, bias_rows, window, carry)

        def put(rows, value):
            # The last run of steps may pass num_steps; every row has stopped by then
            # (limits <= num_steps), and what those steps sample is dropped.
            return rows.at[j].set(value, mode="drop")

        out = WindowOutput(
            token_ids=put(out.token_ids, step_out.sampled_token_ids),
            num_sampled=carry.num_sampled,
            topk_token_ids=put(out.topk_token_ids, step_out.topk_token_ids),
            topk_logprobs=put(out.topk_logprobs, step_out.topk_logprobs),
            sampled_logprobs=put(out.sampled_logprobs, step_out.sampled_logprobs),
            sampled_ranks=put(out.sampled_ranks, step_out.sampled_ranks),
            # A stopped row writes the null page, which counts nothing (models/model.py).
            expert_counts=None
            if out.expert_counts is None
            else out.expert_counts + step_out.expert_counts,
        )
        return carry, out

    def keep_going(state):
        j, carry, _ = state
        return (j < num_steps) & any_active(carry.active)

    def body(state):
        j, carry, out = state
        if steps_per_check == 1:
            carry, out = one_step(j, (carry, out))
        else:

            def run(i, state):
                return one_step(j + i, state)

            carry, out = jax.lax.fori_loop(0, steps_per_check, run, (carry, out))
        return j + steps_per_check, carry, out

    _, carry, out = jax.lax.while_loop(keep_going, body, (jnp.int32(0), carry, out))
    return out, carry.kv_cache, carry.token_cache
