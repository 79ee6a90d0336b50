"""The engine's decode step as a pure, jittable function over an explicit state, for experiments.

    import jax, jax.numpy as jnp
    from jvllm import LLM, SamplingParams
    from jvllm.step_loop import StepLoop

    llm = LLM()
    loop = StepLoop(llm)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    state = loop.prefill(prompts, SamplingParams(temperature=0.0, max_tokens=257))

    @loop.jit  # jax.jit, donating the state's caches
    def run(state):
        def body(i, carry):
            state, tokens, active = carry
            state, out = loop.step(state)
            return state, tokens.at[i].set(out.token_ids), active.at[i].set(out.active)

        shape = (256, state.stops.limits.shape[0])  # [steps, S]
        init = (state, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool))
        return jax.lax.fori_loop(0, 256, body, init)

    state, tokens, active = run(state)
    token_ids = loop.finish(state, tokens, active)  # == LLM.generate's token ids

examples/jitted_step_loop.py runs such an experiment end to end.

`prefill` runs the prompts through the real engine until each has sampled its first token
(chunked prefill, prefix caching and all), allocates the KV blocks for every token the requests
may still sample, and hands back a `DecodeState`: the params, the paged KV cache and its token
cache, each row's next input token, position, slot, block table and sequence length
(`state.carry.inputs`, a StepInputs), its sampling parameters and seed, and its stops. `step` is
the engine's own decode step (forward, logit processors, penalties, sampling with the same
per-request keys, then feeding the token back), so an unchanged body gives `LLM.generate`'s
tokens. A row stops by itself at its stop token ids (EOS included), max_tokens or max_model_len;
after that it writes only the null page and `out.active` is False for it.

Between `prefill` and `finish` the loop owns the engine's requests and KV arrays: the engine
refuses new requests meanwhile. A call that fails while tracing donates nothing: finish with
the state it was given (and `token_ids` of shape [0, S]) to give the engine back. Stop strings are text and are not checked; min_tokens, n > 1,
multi-token bad words and structured outputs are not supported here (`prefill` says so).

What the state holds is what the engine prepared, so two kinds of edit do not do what they seem
to. The sampling parameters come with batch switches set at prefill (`all_greedy`, `any_filter`,
`any_penalties`, ...: `state.carry.inputs.sampling`), which skip work no row asked for: a new
temperature written into a greedy batch is not read. To sample differently, pass `choose`
(any function of the raw logits), or prefill with the parameters you want. And `prefill`
allocates the KV blocks of each row's `limits` (max_tokens, or up to max_model_len): a row
whose limit is raised afterwards writes past its blocks, into the null page, and its tokens go
wrong; prefill with the largest max_tokens you may need, and stop rows early yourself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jvllm.core.decode_window import fits_window, window_limit
from jvllm.core.request import Request
from jvllm.distributed.mesh import replicated
from jvllm.engine.data_parallel import DataParallelEngine
from jvllm.engine.input_processor import PromptType
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.mm_processor import check_no_images
from jvllm.sample.metadata import SamplerOutput
from jvllm.sampling_params import SamplingParams
from jvllm.worker.decode_loop import (
    DecodeCarry,
    WindowInputs,
    decode_step,
    prepare_window_inputs,
)
from jvllm.worker.step_inputs import prepare_step_inputs

__all__ = ["DecodeState", "StepLoop", "StepOutput"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything one decode step reads and writes; S = the rows padded to a decode bucket."""

    params: object  # the model's Params pytree
    # f32[R, V]: rows of logit bias, allowed ids and bad words (inputs.sampling.bias_slot)
    bias_rows: jax.Array
    stops: WindowInputs  # limits i32[S] (tokens a row may still sample), stop_token_ids i32[S, W]
    carry: DecodeCarry  # kv_cache, token_cache, inputs (the next step's), num_sampled, active
    # A model with routed experts: the loop's steps' (token, expert) assignments summed,
    # i32[L_moe, E] (layers/expert_counts.py), which finish() adds to the engine's; None else.
    expert_counts: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    token_ids: jax.Array  # i32[S] the token each row took this step
    active: jax.Array  # bool[S] rows whose token counts (they were decoding)
    logits: jax.Array  # f32[S, V] raw logits the token was sampled from
    sampler: SamplerOutput  # the engine's sample and, when asked for, its logprobs


class StepLoop:
    """The decode loop of an `LLM` or `LLMEngine`, opened up. See the module docstring."""

    def __init__(self, llm):
        self.engine: LLMEngine = getattr(llm, "llm_engine", llm)
        if isinstance(self.engine, DataParallelEngine):
            raise ValueError(  # noqa: TRY004 - a bad setting of the engine, as vLLM reports it
                "the step loop drives one engine replica: build the LLM with "
                "data_parallel_size=1 (tensor_parallel_size may be any)"
            )
        if self.engine.engine_config.speculative_config is not None:
            raise ValueError(
                "the step loop does not run with speculative_config (its steps decode one "
                "token a row); build the LLM without it"
            )
        self._runner = self.engine.model_runner
        self._requests: list[Request] = []  # every prompt's request, in prompt order
        self._rows: list[Request] = []  # the requests still decoding after prefill, row order
        self._shardings = None  # the state's shardings but the params', from prefill

    def prefill(
        self,
        prompts: Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> DecodeState:
        """Prefill `prompts` in the engine and return the state of their decode."""
        engine = self.engine
        if self._requests or engine.has_unfinished_requests():
            raise RuntimeError(
                "StepLoop.prefill needs an idle engine: finish() the previous loop and let "
                "running requests end first"
            )
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts (strings or token id lists)")
        max_num_seqs = engine.engine_config.scheduler_config.max_num_seqs
        if len(prompts) > max_num_seqs:
            raise ValueError(
                f"{len(prompts)} prompts, but the engine runs at most max_num_seqs="
                f"{max_num_seqs} at once; pass fewer or raise max_num_seqs"
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or engine.get_default_sampling_params()] * len(
                prompts
            )
        for params in sampling_params:
            _check_supported(params)
        for prompt in prompts:
            check_no_images(prompt, "the step loop takes text prompts only (LLM.generate)")
        ids = [f"step-loop-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, params in zip(ids, prompts, sampling_params, strict=True):
                engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError):  # nothing of a refused batch stays in the engine
            engine.abort_request(ids)
            raise
        self._requests = [engine.scheduler.get_request(i) for i in ids]
        if not all(fits_window(r) for r in self._requests):
            self._abort_all()
            raise ValueError(
                "the step loop takes at most 16 stop token ids a request and no multi-token "
                "bad_words"
            )
        while any(r.num_output_tokens == 0 and not r.is_finished for r in self._requests):
            engine.step()
        return self._decode_state()

    def step(
        self,
        state: DecodeState,
        choose: Callable[[jax.Array, SamplerOutput], jax.Array] | None = None,
    ) -> tuple[DecodeState, StepOutput]:
        """One decode step of every row: pure and jittable.

        `choose(logits f32[S, V], sampler_output) -> i32[S]` replaces the engine's choice of
        token (the default takes `sampler_output.sampled_token_ids`)."""
        carry, out, logits, token_ids = decode_step(
            self._runner.step, state.params, state.bias_rows, state.stops, state.carry, choose
        )
        counts = state.expert_counts
        if counts is not None:
            counts = counts + out.expert_counts
        # A token counts where its row was decoding before the step.
        step_out = StepOutput(token_ids, state.carry.active, logits, out)
        return dataclasses.replace(state, carry=carry, expert_counts=counts), step_out

    def jit(self, fn: Callable) -> Callable:
        """`jax.jit(fn)` for `fn(state, *args)`, donating the state's arrays but its params,
        which the engine goes on using: each call updates the KV cache in place, as the
        engine's own steps do, instead of copying it. The params travel beside the state, so
        that no call copies them into its outputs either."""

        def split(params, state, *args):
            out = fn(dataclasses.replace(state, params=params), *args)
            # The states leave with the shardings they came in with (XLA would pick its own for
            # some, e.g. bias_rows split over the model axis), so the next call does not compile
            # again and finish() hands the engine arrays laid out as its executables expect.
            return _map_states(
                out,
                lambda s: jax.lax.with_sharding_constraint(
                    dataclasses.replace(s, params=None), self._shardings
                ),
            )

        jitted = jax.jit(split, donate_argnums=1)

        def call(state: DecodeState, *args):
            out = jitted(state.params, dataclasses.replace(state, params=None), *args)
            return _map_states(out, lambda s: dataclasses.replace(s, params=state.params))

        return call

    def finish(self, state: DecodeState, token_ids, active) -> list[list[int]]:
        """Hand the KV arrays back to the engine, end the requests and free their blocks
        -> each prompt's output token ids: its prefill's, then the loop's active ones.

        `token_ids` and `active` are the steps' `StepOutput` fields stacked: [n, S] each."""
        if not self._requests:
            raise RuntimeError("StepLoop.finish: no loop to finish (prefill() first)")
        if any(x.is_deleted() for x in jax.tree.leaves(state)):
            raise ValueError(
                "StepLoop.finish: this state's arrays were donated to a jitted call; pass the "
                "state that call returned"
            )
        runner = self._runner
        runner.kv_cache, runner.token_cache = state.carry.kv_cache, state.carry.token_cache
        runner.bias_rows.rows = state.bias_rows
        if state.expert_counts is not None:
            runner.expert_token_counts = runner.expert_token_counts + np.asarray(
                state.expert_counts
            )
        token_ids, active = np.asarray(token_ids), np.asarray(active)
        outputs = {r.request_id: list(r.output_token_ids) for r in self._requests}
        for row, request in enumerate(self._rows):
            outputs[request.request_id] += token_ids[active[:, row], row].tolist()
        in_order = [outputs[r.request_id] for r in self._requests]
        self._abort_all()
        return in_order

    def _decode_state(self) -> DecodeState:
        """Take the requests still running out of the scheduler and give each the blocks for
        every token it may sample: the loop never comes back to the host for them."""
        engine = self.engine
        self._rows = [r for r in self._requests if not r.is_finished]
        # A window as long as the requests may run (min_tokens is refused in prefill).
        limits = [window_limit(r, engine.max_model_len, engine.max_model_len) for r in self._rows]
        try:
            block_ids, window_block_ids = engine.lend_to_step_loop(self._rows, limits)
            return self._state_over(block_ids, window_block_ids, limits)
        except BaseException:  # whatever failed, the engine takes its requests and blocks back
            self._abort_all()
            raise

    def _state_over(
        self,
        block_ids: list[list[int]],
        window_block_ids: list[list[list[int]]],
        limits: list[int],
    ) -> DecodeState:
        """The loop's state over the lent requests' blocks (and windowed KV groups' tables)."""
        runner = self._runner
        num_rows = len(self._rows)
        bucket = runner.buckets.select(num_rows, num_rows)
        inputs = prepare_step_inputs(
            self._rows,
            [1] * num_rows,
            block_ids,
            bucket,
            runner.block_size,
            runner.max_pages,
            runner.config.vocab_size,
            runner.bias_rows.slots_for(self._rows),
            num_kv_groups=runner.num_kv_groups,
            window_block_ids=window_block_ids,
        )
        # Device arrays on the engine's mesh throughout, as loop.jit returns them: arrays
        # placed otherwise in the first call's state would make its second call compile again.
        on_mesh = lambda tree: jax.device_put(tree, replicated(runner.mesh))
        stops = on_mesh(prepare_window_inputs(self._rows, limits, bucket.num_seqs))
        carry = DecodeCarry(
            runner.kv_cache,
            runner.token_cache,
            on_mesh(inputs),
            on_mesh(np.zeros(bucket.num_seqs, np.int32)),
            on_mesh(np.asarray(stops.limits) > 0),
        )
        counts = runner.expert_token_counts
        if counts is not None:
            counts = on_mesh(np.zeros(counts.shape, np.int32))
        state = DecodeState(runner.params, runner.bias_rows.rows, stops, carry, counts)
        self._shardings = jax.tree.map(
            lambda x: x.sharding, dataclasses.replace(state, params=None)
        )
        return state

    def _abort_all(self) -> None:
        """End the loop's requests through the engine (their blocks go back to the pool)."""
        self.engine.end_step_loop([r.request_id for r in self._requests])
        self._requests, self._rows = [], []


def _map_states(tree, fn):
    """`tree` with fn applied to every DecodeState in it."""
    is_state = lambda x: isinstance(x, DecodeState)
    return jax.tree.map(lambda x: fn(x) if is_state(x) else x, tree, is_leaf=is_state)


def _check_supported(params: SamplingParams) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    unsupported = {
        "n": params.n != 1,
        "min_tokens": params.min_tokens > 0,
        "stop": bool(params.stop),
        "structured_outputs": params.structured_outputs is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ValueError(
            f"the step loop does not support {', '.join(named)} (stop strings are text, "
            "min_tokens bans change mid-loop, n > 1 forks requests, grammar masks are built on "
            "the host); use LLM.generate"
        )
