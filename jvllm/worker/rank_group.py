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

The device arrays: the KV cache [L, V, K, D P, B, H] and the token cache [D P, B] hold each
rank's P pages on its row of devices; each rank's bias rows [R, V] lie on its own row and join
the step as one [D R, V] array without a copy. Inside the step each device runs
worker/step_fn.py's step body on its rank's inputs, sampling included: the step is the one
every engine runs, with the model's MoE layers reaching across the ranks.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.config import ModelConfig
from jvllm.core.engine_config import RunnerConfig
from jvllm.core.kv_groups import KVCacheGroups
from jvllm.core.request import Request
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.distributed.data_parallel_moe import KV_CACHE_SPEC, RANKS_SPEC
from jvllm.distributed.mesh import DP_AXIS, replica_mesh, replicated
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
from jvllm.worker.rank_group_step import GroupExecutables
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


@dataclasses.dataclass
class _Step:
    """One rank's step handed to the group: what its runner would have run alone."""

    scheduler_output: SchedulerOutput
    block_ids: list[list[int]]
    token_bitmask: np.ndarray | None


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

    def _run(self, steps: dict[int, _Step]) -> dict[int, ModelRunnerOutput]:
        """The local ranks' steps (the others padding) in one bucket, run as one."""
        counts = {
            r: [s.scheduler_output.num_scheduled_tokens[q.request_id] for q in _requests(s)]
            for r, s in steps.items()
        }
        sizes = [
            (sum(counts[r]), len(counts[r]), s.scheduler_output.num_steps > 1)
            for r, s in steps.items()
        ]
        if jax.process_count() > 1:  # every process's ranks' steps pick the bucket
            sizes = [size for sizes in gather_objects(sizes) for size in sizes]
            if not sizes:
                return {}  # no rank of any process has a step
        if self.executables.pooling_type is not None:
            return self._run_pool(steps, counts, self._bucket([size[:2] for size in sizes]))
        # A decode window (of speculative rounds, with drafts) where every rank with a step
        # scheduled one; else a step, of which a window's requests take one token each, or
        # verify the drafts of their first round (the rest of their window's blocks stay
        # theirs).
        kind = "step"
        if all(is_window for *_, is_window in sizes):
            kind = self.executables.window_kind
        if kind == "spec_window":  # a decode bucket's rows, k + 1 tokens each
            k = self.layout.num_speculative_tokens
            bucket = self.buckets.window_shape(max(size[1] for size in sizes), k)[0]
        else:
            bucket = self._bucket([size[:2] for size in sizes])
        ranks, windows, drafts = [], [], {}
        for r in self.local_ranks:
            if r not in steps:  # padding, its window's limits 0
                ranks.append(self.executables.padding(bucket, "step"))
                if kind != "step":
                    windows.append(prepare_window_inputs([], [], bucket.num_seqs))
                continue
            step = steps[r]
            requests = _requests(step)
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
                    bias_slots=self.bias_rows[r].slots_for(requests),
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
        args = [self._global(local)]
        if kind != "step":
            args.append(self._global(stack(windows)))
        out, self.kv_cache, self.token_cache = self.executables(bucket, kind)(
            self._step_params(), self.kv_cache, self.token_cache, self._joint_bias_rows(), *args
        )
        self.num_group_steps += 1
        self.num_windows += kind != "step"
        out = jax.tree.map(self._local_rows, out)  # [local ranks, ...] each, on the host
        results = {}
        for r, step in steps.items():
            i = self.local_ranks.index(r)
            rank_out = jax.tree.map(lambda a, i=i: a[i], out)
            sampling = jax.tree.map(lambda a, i=i: a[i], local.sampling)
            results[r] = read_rank_results(
                kind, rank_out, step.scheduler_output, sampling, drafts[r]
            )
            if self.draft is not None:
                self.proposals[r].keep_drafts(rank_out.draft_tokens, _requests(step))
                if kind == "spec_window":  # the drafts past a run cut short go
                    self.proposals[r].drop_drafts(cut_short(results[r], _requests(step)))
            self.expert_token_counts[r] = self.expert_token_counts[r] + rank_out.expert_counts
        return results

    def _run_pool(self, steps: dict[int, _Step], counts, bucket: Bucket) -> dict[int, np.ndarray]:
        """The local ranks' pooling steps (the others padding) in `bucket`, run as one -> each
        one's pooled rows f32[num_reqs, H] (ModelRunner.execute_pooling's)."""
        pooling_type, ranks = self.executables.pooling_type, []
        for r in self.local_ranks:
            if r not in steps:
                ranks.append(self.executables.padding(bucket, "pool"))
                continue
            step, requests = steps[r], _requests(steps[r])
            window_ids = window_block_ids(step.scheduler_output)  # a windowed layer's tables
            inputs = self.layout.inputs(
                requests, counts[r], step.block_ids, bucket, window_block_ids=window_ids
            )
            ranks.append(prepare_pool_inputs(inputs, requests, counts[r], pooling_type))
        local = jax.tree.map(lambda *a: np.stack(a), *ranks)  # [local ranks, ...]
        exe = self.executables(bucket, "pool")
        pooled, self.kv_cache = exe(self.params, self.kv_cache, self._global(local))
        self.num_group_steps += 1
        pooled = self._local_rows(pooled)  # [local ranks, S, H]
        return {
            r: pooled[self.local_ranks.index(r)][: len(_requests(step))]
            for r, step in steps.items()
        }

    def _bucket(self, sizes: list[tuple[int, int]]) -> Bucket:
        """The one bucket of the ranks' steps of (tokens, sequences) `sizes`: a decode bucket
        only where every rank decodes one token a sequence."""
        num_tokens, num_seqs = max(t for t, _ in sizes), max(s for _, s in sizes)
        if all(t == s for t, s in sizes):
            return self.buckets.select(num_seqs, num_seqs)
        return next(b for b in self.buckets.fitting(num_tokens, num_seqs) if not b.is_decode)

    def _global(self, local):
        """The local ranks' stacked inputs -> the group's, every array [D, ...] cut over
        "data" (within one process, the arrays as they are: the step places them)."""
        if jax.process_count() == 1:
            return local
        sharding = NamedSharding(self.mesh, RANKS_SPEC)
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local)

    def _local_rows(self, array: jax.Array) -> np.ndarray:
        """An output [D, ...] -> the local ranks' rows on the host, in local_ranks' order."""
        rows = {}
        for shard in array.addressable_shards:
            rows.setdefault(shard.index[0].start or 0, shard.data)
        return np.stack([np.asarray(rows[r])[0] for r in self.local_ranks])

    def _joint_bias_rows(self) -> jax.Array:
        """The local ranks' bias rows [R, V], each on its rank's devices, as the group's one
        [D R, V] array cut over "data" (their buffers as they are)."""
        rows = [self.bias_rows[r].rows for r in self.local_ranks]
        num_slots, vocab = rows[0].shape
        shards = [s.data for r in rows for s in r.addressable_shards]
        return jax.make_array_from_single_device_arrays(
            (self.num_ranks * num_slots, vocab), NamedSharding(self.mesh, RANKS_SPEC), shards
        )


def _requests(step: _Step) -> list:
    return step.scheduler_output.scheduled_requests


class _NoCompiler:
    """What the engine asks a runner's compiler: the group compiles its executables itself
    (one a bucket and kind: up front with compile_all_buckets, else on first use), nothing in
    the background."""

    lockstep = False
    compile_wait_seconds = 0.0

    def cancel_compiles(self) -> None:
        pass

    def wait_for_compiles(self) -> None:
        pass


class RankRunner:
    """One rank's view of the group, what its LLMEngine runs as its model runner."""

    encoder = None  # images are refused across ranks

    def __init__(self, group: RankGroupRunner, rank: int):
        self.group, self.rank = group, rank
        self.config = group.config
        self.compiler = _NoCompiler()
        self.dispatch_seconds = self.device_wait_seconds = 0.0

    @property
    def params(self):
        return self.group.params

    @property
    def adapters(self):
        """This rank's AdapterSlots (None: no LoRA), which its engine reads adapters with."""
        return self.group.adapters and self.group.adapters.slots[self.rank]

    @property
    def kv_cache(self):
        return self.group.kv_cache

    @property
    def expert_token_counts(self) -> np.ndarray:
        return self.group.expert_token_counts[self.rank]

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        block_ids: list[list[int]],
        token_bitmask: np.ndarray | None = None,
    ) -> ModelRunnerOutput:
        """ModelRunner.execute_model's contract: this rank's step, run in the group's."""
        step = _Step(scheduler_output, block_ids, token_bitmask)
        return self.group.hand_over.submit(self.rank, step)

    def execute_pooling(
        self, scheduler_output: SchedulerOutput, block_ids: list[list[int]]
    ) -> np.ndarray:
        """ModelRunner.execute_pooling's contract: this rank's pooling step, run in the
        group's."""
        step = _Step(scheduler_output, block_ids, None)
        return self.group.hand_over.submit(self.rank, step)

    def propose_drafts(
        self, requests: list[Request], block_ids: list[list[int]]
    ) -> dict[str, tuple[int, list[int]]]:
        """The drafts this rank's last step proposed for `requests` (DraftProposals.propose)."""
        return self.group.proposals[self.rank].propose(requests, block_ids)
