"""The D data-parallel ranks of a mixture of experts stepping as one (vLLM's data-parallel
attention with expert parallelism over data x tensor): every step of every rank runs in ONE
jitted call over the ("data", "model") mesh, whose MoE layers spread the experts over all
D x T devices and exchange the ranks' tokens (distributed/data_parallel_moe.py).

Each rank keeps its own engine (scheduler, KV pool and prefix cache, requests, logit-bias
rows); its runner here (`RankRunner`) is what that engine's LLMEngine steps. A step of the
group: every rank's engine steps in its own thread (engine/data_parallel.py); a rank that
scheduled tokens hands them over (`RankRunner.execute_model`, step_hand_over.py) and waits;
once every rank has handed its step over or stepped without one, the last of them pads every
rank's step to one bucket (a rank with nothing contributes a step of padding, which writes
only its null page), runs the group's step (or, where every rank scheduled a decode window,
its window: worker/rank_group_step.py) and gives each rank its rows back.

Across processes (jax.distributed, one rank a process: engine/process_data_parallel.py) the
group is the same SPMD program: each process holds its rank's row of the mesh and its engine,
and before each group step the processes exchange their ranks' step sizes (a small all-gather)
so that every one pads to the same bucket, and steps, work or not.

With async scheduling the group's next decode step may be dispatched ahead of the ranks'
schedules, and taken where it holds them all (worker/rank_group_ahead.py).

The device arrays: the KV cache [L, V, K, D P, B, H] and the token cache [D P, B] hold each
rank's P pages on its row of devices; each rank's bias rows [R, V] lie on its own row and join
the step as one [D R, V] array without a copy. Inside the step each device runs
worker/step_fn.py's step body on its rank's inputs, sampling included: the step is the one
every engine runs, with the model's MoE layers reaching across the ranks.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.config import ModelConfig
from jvllm.core.engine_config import RunnerConfig
from jvllm.core.kv_groups import KVCacheGroups
from jvllm.distributed.data_parallel_moe import (
    KV_CACHE_SPEC,
    RANKS_SPEC,
    local_rank_rows,
    ranks_input,
)
from jvllm.distributed.mesh import DP_AXIS, join_over_ranks, replica_mesh, replicated
from jvllm.distributed.multihost import gather_objects
from jvllm.models.model import num_moe_layers
from jvllm.worker.bias_rows import BiasRows, set_row
from jvllm.worker.buckets import Bucket
from jvllm.worker.decode_loop import prepare_window_inputs
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.kv_layout import new_kv_cache
from jvllm.worker.pooler import prepare_pool_inputs
from jvllm.worker.proposal_runner import DraftProposals
from jvllm.worker.rank_adapters import RankAdapters
from jvllm.worker.rank_group_ahead import GroupStepsAhead
from jvllm.worker.rank_group_step import GroupExecutables
from jvllm.worker.rank_runner import RankRunner, RankStep, step_requests
from jvllm.worker.runner_output import ModelRunnerOutput
from jvllm.worker.scheduled_step import read_rank_results
from jvllm.worker.spec_window import cut_short, first_round
from jvllm.worker.step_compiler import abstract_state
from jvllm.worker.step_hand_over import StepHandOver
from jvllm.worker.step_inputs import (
    scheduled_drafts,
    split_bitmask,
    window_block_ids,
)
from jvllm.worker.step_layout import step_attention, step_buckets, step_layout


class RankGroupRunner:
    """The group's device side: the params on the D x T mesh, every rank's KV and token
    pages, the jitted step, and the hand-over of the ranks' steps."""

    def __init__(
        self,
        config: ModelConfig,
        params,
        runner_config: RunnerConfig,
        *,
        num_blocks: int,
        mesh: Mesh,
        kv_groups: KVCacheGroups | None = None,
        draft: DraftModel | None = None,
    ):
        """`config` and `params` as load_model gives them on `mesh` (the experts placed over
        its D x T devices); `num_blocks`: each rank's KV pool (null block included); `draft`:
        speculative decoding's draft model or head, its params on `mesh` (every rank's step
        runs it: worker/rank_group_step.py), its KV pages each rank's as the target's."""
        self.config, self.params, self.mesh = config, params, mesh
        self.num_ranks = num_ranks = mesh.shape[DP_AXIS]
        # The ranks whose devices (a row of the mesh) are this process's: every rank in one
        # process, one a process across processes.
        here = jax.process_index()
        self.local_ranks = [r for r in range(num_ranks) if mesh.devices[r, 0].process_index == here]
        block_size = runner_config.block_size
        # As ModelRunner's steps (or its pooling steps), drafts scored in them, no images.
        self.layout = step_layout(config, runner_config, kv_groups, None)
        self.buckets = step_buckets(runner_config)

        def kv_cache(config: ModelConfig, num_slots: int | None):  # each rank's pages
            return new_kv_cache(
                config,
                mesh,
                KV_CACHE_SPEC,
                num_blocks=num_ranks * num_blocks,
                block_size=block_size,
                attention_backend=runner_config.attention_backend,
                kv_cache_dtype=runner_config.kv_cache_dtype,
                num_slots=num_slots,
            )

        self.kv_cache = kv_cache(config, kv_groups and kv_groups.num_slots)
        self.draft = draft
        if draft is not None:  # kv_cache becomes the pair (target's, draft's)
            self.kv_cache = (self.kv_cache, kv_cache(draft.config, None))
            k = runner_config.num_speculative_tokens
            # Each local rank's drafts of its last step, until its scheduler asks.
            self.proposals = {r: DraftProposals(block_size, k) for r in self.local_ranks}
        self.token_cache = jnp.zeros(
            (num_ranks * num_blocks, block_size), jnp.int32, device=NamedSharding(mesh, RANKS_SPEC)
        )  # [D P, B]
        set_bias_row = jax.jit(set_row, donate_argnums=0)
        self.bias_rows = {
            r: BiasRows(
                runner_config.max_num_seqs + 1,
                config.vocab_size,
                set_bias_row,
                replicated(replica_mesh(mesh, r)),
            )
            for r in self.local_ranks
        }
        # A `config` with max_loras > 0: each rank's own adapter slots (worker/rank_adapters.py).
        self.adapters = None
        if config.max_loras:
            max_cpu_loras = runner_config.max_cpu_loras
            self.adapters = RankAdapters(config, mesh, self.local_ranks, max_cpu_loras)
        attn = step_attention(config, self.layout, runner_config.attention_backend, kv_groups)
        # What every executable is lowered for, fixed once the arrays exist (sleep mode frees
        # them, worker/device_sleep.py, and puts them back so).
        self._state_spec = abstract_state((self.params, self.kv_cache, self.token_cache, None))
        num_slots, vocab = self.bias_rows[self.local_ranks[0]].rows.shape
        bias = jax.ShapeDtypeStruct(
            (num_ranks * num_slots, vocab), jnp.float32, sharding=NamedSharding(mesh, RANKS_SPEC)
        )
        state_spec = (abstract_state(self._step_params()), *self._state_spec[1:3], bias)
        self.executables = GroupExecutables(
            config, self._target_params(), mesh, attn, runner_config, self.layout, state_spec, draft
        )
        # Each local rank's MoE layers' (token, expert) assignments of its own tokens,
        # i64[L_moe, E].
        self.expert_token_counts = {
            r: np.zeros((num_moe_layers(config), config.num_experts), np.int64)
            for r in self.local_ranks
        }
        # The ranks' engines hand their steps to the group's (step_hand_over.py): every
        # front step begins it, and each rank's engine finishes it.
        self.hand_over = StepHandOver(self.local_ranks, self._run, jax.process_count() > 1)
        self.num_group_steps = self.num_windows = 0  # the group's steps, the windows among them
        # Async scheduling's step run ahead (worker/rank_group_ahead.py), waited for across
        # CPU processes.
        waits = jax.process_count() > 1 and mesh.devices.flat[0].platform == "cpu"
        self.ahead = GroupStepsAhead(runner_config.async_scheduling, block_size, waits)

    @property
    def num_compilations(self) -> int:
        return len(self.executables)

    def _step_params(self):
        """The params argument of the step executables: the target's, or (target's, draft's)
        with a draft model or head."""
        target = self._target_params()
        return target if self.draft is None else (target, self.draft.params)

    def _target_params(self):
        """The target's params, with every rank's adapter slots where it serves LoRA."""
        return self.params if self.adapters is None else self.adapters.with_slots(self.params)

    def compile_all(self) -> float:
        """Compile every bucket's executables up front -> the seconds it took."""
        start = time.perf_counter()
        self.executables.compile_all(self.buckets)
        return time.perf_counter() - start

    def rank_runner(self, rank: int) -> RankRunner:
        return RankRunner(self, rank)

    def _run(self, steps: dict[int, RankStep]) -> dict[int, ModelRunnerOutput]:
        """The local ranks' steps (the others padding) in one bucket, run as one: the step
        dispatched ahead where it holds every rank's (async scheduling), else dispatched now."""
        counts = {
            r: [s.scheduler_output.num_scheduled_tokens[q.request_id] for q in step_requests(s)]
            for r, s in steps.items()
        }
        # Each rank's bias rows sent first (a row sent since a step ran ahead drops it); a
        # pooling runner's requests take none.
        bias_slots = {}
        if self.executables.pooling_type is None:
            bias_slots = {
                r: self.bias_rows[r].slots_for(step_requests(s)) for r, s in steps.items()
            }
        ahead = self.ahead.take()
        # Each rank's rows of the step run ahead that hold its step now (None: they do not).
        sends = {r: self.bias_rows[r].num_sends for r in self.local_ranks}  # none after this
        rows_of = {r: self.ahead.rows(ahead, r, s, sends[r]) for r, s in steps.items()}
        sizes = [
            (
                sum(counts[r]),
                len(counts[r]),
                s.scheduler_output.num_steps > 1,
                rows_of[r] is not None,
                self.ahead.can_follow(s),
            )
            for r, s in steps.items()
        ]
        if jax.process_count() > 1:  # every process's ranks' steps pick the bucket
            sizes = [size for sizes in gather_objects(sizes) for size in sizes]
            if not sizes:
                return {}  # no rank of any process has a step
        if self.executables.pooling_type is not None:
            return self._run_pool(steps, counts, self._bucket([size[:2] for size in sizes]))
        drafts: dict[int, list[list[int]] | None] = {}
        if ahead is not None and all(size[3] for size in sizes):  # on the device already
            self.ahead.num_used += 1
            first = ahead[self.local_ranks[0]]  # each rank's holds the group's outputs
            kind, bucket, out, inputs = "step", first.bucket, first.out, first.inputs
            flags = {r: (ahead[r].any_logprobs, False) for r in steps}
        else:
            self.ahead.num_dropped += ahead is not None
            rows_of = {r: list(range(len(counts[r]))) for r in steps}
            kind, bucket, out, inputs, flags = self._dispatch(
                steps, counts, bias_slots, sizes, drafts
            )
        if kind == "step" and bucket.is_decode and all(size[4] for size in sizes):
            self._run_ahead(steps, rows_of, bucket, out, inputs, flags, sends)
        local_rows = lambda a: local_rank_rows(a, self.local_ranks)
        host_out = jax.tree.map(local_rows, out)  # [local ranks, ...] each, on the host
        results = {}
        for r, step in steps.items():
            i = self.local_ranks.index(r)
            rank_out = jax.tree.map(lambda a, i=i: a[i], host_out)
            so = step.scheduler_output
            results[r] = read_rank_results(kind, rank_out, so, rows_of[r], *flags[r], drafts.get(r))
            if self.draft is not None:
                self.proposals[r].keep_drafts(rank_out.draft_tokens, step_requests(step))
                if kind == "spec_window":  # the drafts past a run cut short go
                    self.proposals[r].drop_drafts(cut_short(results[r], step_requests(step)))
            self.expert_token_counts[r] = self.expert_token_counts[r] + rank_out.expert_counts
        return results

    def _dispatch(self, steps: dict[int, RankStep], counts, bias_slots, sizes, drafts: dict):
        """Lay every local rank's step (the others padding) out in one bucket and dispatch it
        -> (kind, bucket, its outputs [D, ...], its inputs, each rank's (any_logprobs,
        any_prompt_logprobs)); `drafts` gets each rank's scheduled drafts."""
        # A decode window (of speculative rounds, with drafts) where every rank with a step
        # scheduled one; else a step, of which a window's requests take one token each, or
        # verify the drafts of their first round (the rest of their window's blocks stay
        # theirs).
        kind = "step"
        if all(size[2] for size in sizes):
            kind = self.executables.window_kind
        if kind == "spec_window":  # a decode bucket's rows, k + 1 tokens each
            k = self.layout.num_speculative_tokens
            bucket = self.buckets.window_shape(max(size[1] for size in sizes), k)[0]
        else:
            bucket = self._bucket([size[:2] for size in sizes])
        ranks, windows = [], []
        for r in self.local_ranks:
            if r not in steps:  # padding, its window's limits 0
                ranks.append(self.executables.padding(bucket, "step"))
                if kind != "step":
                    windows.append(prepare_window_inputs([], [], bucket.num_seqs))
                continue
            step = steps[r]
            requests = step_requests(step)
            drafts[r] = scheduled_drafts(step.scheduler_output)
            draft_lists = drafts[r]
            if kind == "spec_window":
                draft_lists, counts[r] = first_round(drafts[r], len(requests), k)
            masks = split_bitmask(step.token_bitmask, len(requests))
            ranks.append(
                self.layout.inputs(
                    requests,
                    counts[r],
                    step.block_ids,
                    bucket,
                    bias_slots=bias_slots[r],
                    adapter_slots=self.adapters and self.adapters.slots_for(r, requests),
                    token_bitmask=masks[0],
                    draft_token_ids=draft_lists,
                    draft_bitmask=masks[1],
                    window_block_ids=window_block_ids(step.scheduler_output),
                )
            )
            if kind != "step":
                limits = step.scheduler_output.window_limits
                limits = [limits[q.request_id] for q in requests]
                windows.append(prepare_window_inputs(requests, limits, bucket.num_seqs))
        stack = lambda inputs: jax.tree.map(lambda *a: np.stack(a), *inputs)  # [local ranks, ...]
        local = stack(ranks)
        args = [ranks_input(self.mesh, local)]
        if kind != "step":
            args.append(ranks_input(self.mesh, stack(windows)))
        out, self.kv_cache, self.token_cache = self.executables(bucket, kind)(
            self._step_params(), self.kv_cache, self.token_cache, self._joint_bias_rows(), *args
        )
        self.num_group_steps += 1
        self.num_windows += kind != "step"
        sampling = local.sampling
        flags = {}
        for r in steps:
            i = self.local_ranks.index(r)
            flags[r] = (bool(sampling.any_logprobs[i]), bool(sampling.any_prompt_logprobs[i]))
        return kind, bucket, out, args[0], flags

    def _run_ahead(
        self, steps: dict[int, RankStep], rows_of, bucket: Bucket, out, inputs, flags, sends
    ):
        """Dispatch the group's decode step after this one (async scheduling), each rank's
        rows `rows_of` (its requests') fed the tokens this step sampled, on the device; every
        other row stays inactive; `sends`: each local rank's bias rows sent so far."""
        active = np.zeros((len(self.local_ranks), bucket.num_seqs), bool)  # [local ranks, S]
        for r in steps:
            active[self.local_ranks.index(r), rows_of[r]] = True
        exe = self.executables(bucket, "ahead")
        (ahead_out, next_inputs), self.kv_cache, self.token_cache = exe(
            self._step_params(),
            self.kv_cache,
            self.token_cache,
            self._joint_bias_rows(),
            inputs,
            out.sampled_token_ids,
            ranks_input(self.mesh, active),
        )
        self.num_group_steps += 1
        self.ahead.keep(steps, rows_of, bucket, flags, ahead_out, next_inputs, sends)

    def _run_pool(
        self, steps: dict[int, RankStep], counts, bucket: Bucket
    ) -> dict[int, np.ndarray]:
        """The local ranks' pooling steps (the others padding) in `bucket`, run as one -> each
        one's pooled rows f32[num_reqs, H] (ModelRunner.execute_pooling's)."""
        pooling_type, ranks = self.executables.pooling_type, []
        for r in self.local_ranks:
            if r not in steps:
                ranks.append(self.executables.padding(bucket, "pool"))
                continue
            step, requests = steps[r], step_requests(steps[r])
            window_ids = window_block_ids(step.scheduler_output)  # a windowed layer's tables
            inputs = self.layout.inputs(
                requests, counts[r], step.block_ids, bucket, window_block_ids=window_ids
            )
            ranks.append(prepare_pool_inputs(inputs, requests, counts[r], pooling_type))
        local = jax.tree.map(lambda *a: np.stack(a), *ranks)  # [local ranks, ...]
        exe = self.executables(bucket, "pool")
        pooled, self.kv_cache = exe(self.params, self.kv_cache, ranks_input(self.mesh, local))
        self.num_group_steps += 1
        pooled = local_rank_rows(pooled, self.local_ranks)  # [local ranks, S, H]
        return {
            r: pooled[self.local_ranks.index(r)][: len(step_requests(step))]
            for r, step in steps.items()
        }

    def _bucket(self, sizes: list[tuple[int, int]]) -> Bucket:
        """The one bucket of the ranks' steps of (tokens, sequences) `sizes`: a decode bucket
        only where every rank decodes one token a sequence."""
        num_tokens, num_seqs = max(t for t, _ in sizes), max(s for _, s in sizes)
        if all(t == s for t, s in sizes):
            return self.buckets.select(num_seqs, num_seqs)
        return next(b for b in self.buckets.fitting(num_tokens, num_seqs) if not b.is_decode)

    def _joint_bias_rows(self) -> jax.Array:
        """The local ranks' bias rows [R, V], each on its rank's devices, as the group's one
        [D R, V] array cut over "data" (their buffers as they are)."""
        return join_over_ranks([self.bias_rows[r].rows for r in self.local_ranks], 0, self.mesh)
