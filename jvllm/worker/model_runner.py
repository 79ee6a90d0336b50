"""The model runner: owns the parameters, the paged KV array and every `jax.jit` entry point."""

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.attention.backends import get_attention
from jvllm.attention.reference import pages_per_chunk
from jvllm.config import ModelConfig
from jvllm.core.scheduler import SchedulerOutput
from jvllm.distributed.mesh import TP_AXIS, make_mesh, replicated
from jvllm.distributed.sharded_model import KV_CACHE_SPEC, sharded_model
from jvllm.layers.scan import unstack_layers, use_unstacked_layers
from jvllm.logger import init_logger
from jvllm.lora.slots import AdapterSlots, update_columns, with_slot_params
from jvllm.models.model import param_axes
from jvllm.sample.plan import SamplerPlan, choose_plan, use_sampler_plans
from jvllm.worker.async_step import StepAhead, can_run_ahead, next_decode_step, rows_ahead
from jvllm.worker.bias_rows import BiasRows, set_row
from jvllm.worker.buckets import MIXED_TILE_Q, Bucket, BucketSpec
from jvllm.worker.decode_loop import (
    prepare_window_inputs,
    run_window,
    window_steps_per_check,
)
from jvllm.worker.executables import Executables
from jvllm.worker.kv_layout import allocate_kv_cache, kv_cache_shape, kv_cache_spec
from jvllm.worker.pooler import pool_step, prepare_pool_inputs
from jvllm.worker.runner_output import ModelRunnerOutput, fetch_output
from jvllm.worker.step_fn import model_step, single_step
from jvllm.worker.step_inputs import StepInputs, prepare_step_inputs

logger = init_logger(__name__)

Shape = tuple[Bucket, str, SamplerPlan]  # (bucket, kind of executable, sampler plan)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        buckets: BucketSpec,
        attention_backend: str,
        kv_cache_dtype: str = "auto",
        max_logprobs: int = 20,
        logprobs_mode: str = "raw_logprobs",
        max_num_seqs: int = 128,
        num_scheduler_steps: int = 1,
        async_scheduling: bool = False,
        mesh: Mesh | None = None,
        pooling_type: str | None = None,
        max_cpu_loras: int = 0,
    ):
        """`params` already lie on `mesh` (the loaders place them); None: JAX's default
        device. Every array the runner makes lies on the same devices. `pooling_type` (a
        pooling runner's, pooler_config.py): its steps pool (`execute_pooling`), never sample.
        A `config` with max_loras > 0 serves LoRA adapters (jvllm/lora/): `params` are the
        base model's, and the runner adds the empty slots."""
        self.config = config
        self.mesh = mesh = mesh or make_mesh()
        self.adapters = None
        if config.max_loras:
            params = with_slot_params(params, config, replicated(mesh))
            update = jax.jit(update_columns, static_argnums=3)
            self.adapters = AdapterSlots(config, max_cpu_loras, update)
        self.pooling_type = pooling_type
        # On a GPU the layers' weights as one array per layer (layers/scan.py): the caller's
        # stacked arrays are deleted as they are split.
        self.layers_unstacked = use_unstacked_layers()
        if self.layers_unstacked:
            params = unstack_layers(params, param_axes(config))
        self.params = params
        num_shards = mesh.shape[TP_AXIS]
        self.block_size = block_size
        self.buckets = buckets
        self.attention_backend = attention_backend
        # Block tables are padded so that the reference backend's page chunks (decode and mixed)
        # tile them exactly: a chunk that ran past the end would be clamped back onto other pages.
        chunk = math.lcm(pages_per_chunk(block_size, 1), pages_per_chunk(block_size, MIXED_TILE_Q))
        self.max_pages = math.ceil(math.ceil(max_model_len / block_size) / chunk) * chunk
        self.kv_cache = allocate_kv_cache(
            kv_cache_spec(config.dtype, attention_backend, kv_cache_dtype),
            kv_cache_shape(config, num_blocks, block_size, num_shards),
            NamedSharding(mesh, KV_CACHE_SPEC),
        )
        self.token_cache = jnp.zeros(
            (num_blocks, block_size), jnp.int32, device=replicated(mesh)
        )  # [P, B]
        self._set_bias_row = jax.jit(set_row, donate_argnums=0)
        # One row per running request at most, plus the shared zero row.
        self.bias_rows = BiasRows(
            max_num_seqs + 1, config.vocab_size, self._set_bias_row, replicated(mesh)
        )
        self.max_logprobs = max_logprobs
        attn = get_attention(
            attention_backend, sm_scale=config.sm_scale, logit_softcap=config.attn_logit_softcap
        )
        # The step body as a pure function of (params, kv_cache, token_cache, bias_rows,
        # inputs), statics bound: the decode windows and jvllm.step_loop chain it.
        self.model = sharded_model(config, mesh, attn, self.layers_unstacked)
        self.step = functools.partial(
            model_step,
            model=self.model,
            max_logprobs=max_logprobs,
            logprobs_mode=logprobs_mode,
        )
        # Decode windows: one more executable per decode bucket, for up to k steps a call.
        self.num_scheduler_steps = num_scheduler_steps
        self.window_steps_per_check = window_steps_per_check()
        # Async scheduling: one more executable per decode bucket, the step after a step.
        self.async_scheduling = async_scheduling
        # On a GPU, a step runs the executable of its sampler plan once that is compiled (in
        # the background, on the plan's first step) and the DYNAMIC one until then.
        self.sampler_plans = use_sampler_plans()
        self._ahead: StepAhead | None = None
        self.num_steps_ahead_used = 0
        self.num_steps_ahead_dropped = 0
        # What every executable is lowered for, fixed once the arrays exist.
        self._state_spec = self._abstract_state()
        self._compiled = Executables(
            lambda shape: self._compile(shape, self._state_spec),
            lambda shape: _describe(*shape, num_scheduler_steps),
            lockstep=jax.process_count() > 1,  # every process's steps must be the same
        )
        self.warmup_seconds = 0.0
        # Where execute_model's time goes: calling the executable until it returns (argument
        # handling and host-to-device copies; on CPU the computation too, which XLA:CPU runs
        # inline for small steps), then waiting for the results (on a GPU, the device time
        # that the host's work did not hide).
        self.dispatch_seconds = 0.0
        self.device_wait_seconds = 0.0

    @property
    def lockstep(self) -> bool:
        """Whether this runner is one of several processes' (compiles never in background)."""
        return self._compiled.lockstep

    @property
    def num_compilations(self) -> int:
        return len(self._compiled)

    @property
    def compile_seconds(self) -> float:
        """Every compile's own time, foreground or background."""
        return self._compiled.compile_seconds

    @property
    def compile_wait_seconds(self) -> float:
        """The time steps waited for compiles: what compiling added to requests' latency."""
        return self._compiled.wait_seconds

    def _abstract_state(self):
        """(params, kv_cache, token_cache, bias_rows) as `jax.ShapeDtypeStruct`s: what the
        step is lowered for, by compiling threads too while warm-up runs donate the arrays."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            (self.params, self.kv_cache, self.token_cache, self.bias_rows.rows),
        )

    def all_shapes(self) -> list[Shape]:
        """Every (bucket, kind, DYNAMIC) this runner can run: kind "step", "window" (a decode
        window) or "ahead" (the decode step after a step, for async scheduling). The other
        plans' executables compile when a step first asks for them."""
        buckets = self.buckets.all_buckets()
        if self.pooling_type is not None:
            return [(b, "pool", SamplerPlan.DYNAMIC) for b in buckets]
        decode = [b for b in buckets if b.is_decode]
        shapes = [(b, "step") for b in buckets]
        if self.num_scheduler_steps > 1:
            shapes += [(b, "window") for b in decode]
        if self.async_scheduling:
            shapes += [(b, "ahead") for b in decode]
        return [(b, kind, SamplerPlan.DYNAMIC) for b, kind in shapes]

    def _jitted(self, kind: str, plan: SamplerPlan):
        """The jitted entry point of a kind of executable, its sampler plan bound."""
        if kind == "pool":
            pool = functools.partial(pool_step, forward=self.model.forward)
            return jax.jit(pool, donate_argnums=1)
        step = functools.partial(self.step, plan=plan)
        if kind == "window":
            fn = functools.partial(
                run_window,
                step=step,
                num_steps=self.num_scheduler_steps,
                steps_per_check=self.window_steps_per_check,
                max_logprobs=self.max_logprobs,
            )
        elif kind == "ahead":
            fn = functools.partial(next_decode_step, step=step)
        else:
            fn = functools.partial(single_step, step=step)
        return jax.jit(fn, donate_argnums=(1, 2))

    def _compile(self, shape: Shape, state) -> jax.stages.Compiled:
        bucket, kind, plan = shape
        dummy = self._padding_step(bucket)
        args = [*state, dummy]
        if kind == "pool":
            args = [*state[:2], prepare_pool_inputs(dummy, [], [], self.pooling_type)]
        elif kind == "window":
            args.append(prepare_window_inputs([], [], bucket.num_seqs))
        elif kind == "ahead":
            args += [np.zeros(bucket.num_seqs, np.int32), np.zeros(bucket.num_seqs, bool)]
        return self._jitted(kind, plan).lower(*args).compile()

    def _padding_step(self, bucket: Bucket) -> StepInputs:
        """A step of padding alone in `bucket`, for lowering and warm-up runs."""
        no_adapters = None if self.adapters is None else np.zeros(0, np.int32)
        return prepare_step_inputs(
            [],
            [],
            [],
            bucket,
            self.block_size,
            self.max_pages,
            self.config.vocab_size,
            adapter_slots=no_adapters,
        )

    def adapter_slots_for(self, requests) -> np.ndarray | None:
        """Each request's LoRA slot (-1: none), its adapter put in one first; None where the
        engine serves no adapters."""
        if self.adapters is None:
            return None
        ids = [r.lora_request.lora_int_id if r.lora_request else None for r in requests]
        return self.adapters.slots_for(self.params, ids)

    def _executable(
        self, bucket: Bucket, kind: str = "step", plan: SamplerPlan = SamplerPlan.DYNAMIC
    ) -> jax.stages.Compiled:
        """The executable of a step in `bucket`: its plan's once that is compiled; until then
        the DYNAMIC one, the plan's compiling in the background. A step compiles the plan's
        itself where it would compile the DYNAMIC one, and in lockstep (every process runs the
        same executables, so none can wait on a thread)."""
        dynamic = (bucket, kind, SamplerPlan.DYNAMIC)
        if plan is SamplerPlan.DYNAMIC:
            return self._compiled.wait(dynamic)
        planned = (bucket, kind, plan)
        exe = self._compiled.get(planned)
        if exe is not None:
            return exe
        exe = self._compiled.get(dynamic)
        if exe is None or self._compiled.lockstep:
            return self._compiled.wait(planned)
        self._compiled.compile_in_background([planned])
        return exe

    def _plan(self, inputs: StepInputs) -> SamplerPlan:
        return choose_plan(inputs.sampling) if self.sampler_plans else SamplerPlan.DYNAMIC

    def compile_all(self, progress: bool = True) -> float:
        """Compile every shape up front so that nothing compiles while serving but sampler
        plans' executables (sample/plan.py), two at a time;
        -> the seconds spent compiling. Each bucket's warm-up run is dispatched as soon as it
        is ready and executes alongside the compiles (`warmup_seconds` counts the dispatches
        and the wait for the last runs)."""
        start = time.perf_counter()
        self._compiled.compile_now(self.all_shapes(), progress, self._warm_up_when_compiled)
        self._compile_set_bias_row()
        compiled = time.perf_counter()
        jax.block_until_ready(self.kv_cache)  # the warm-up runs are chained through the cache
        self.warmup_seconds += time.perf_counter() - compiled
        return compiled - start

    def compile_in_background(self) -> None:
        """Queue every shape, cheapest first, to compile in background threads: steps run
        meanwhile, in the smallest compiled bucket that holds them, or wait for their own.
        Nothing warms these up (see _warm_up): the threads must not touch the donated arrays,
        and with the layer scan a first call costs at most a few tenths of a second more."""
        self._compile_set_bias_row()
        kind_order = {"step": 0, "pool": 0, "window": 1, "ahead": 2}
        self._compiled.compile_in_background(
            sorted(
                self.all_shapes(), key=lambda s: (s[0].num_tokens, s[0].tile_q, kind_order[s[1]])
            )
        )

    def wait_for_compiles(self) -> None:
        """Return when every queued background compile is done."""
        self._compiled.wait_all()

    def cancel_compiles(self) -> None:
        """Drop the queued background compiles (running ones finish); a later step that needs
        one of their shapes compiles it then."""
        self._compiled.cancel_queued()

    def _compile_set_bias_row(self) -> None:
        rows = self.bias_rows.rows
        self._set_bias_row.lower(rows, np.int32(0), np.zeros(rows.shape[1], np.float32)).compile()

    def _warm_up_when_compiled(self, shape: Shape) -> None:
        bucket, kind, _ = shape
        if kind == "step":
            self._warm_up(bucket)

    def _select_bucket(self, num_tokens: int, num_seqs: int, kind: str) -> tuple[Bucket, bool]:
        """The smallest bucket for the step; while its executable is not compiled, the
        smallest compiled one that holds the step (the exact one then compiles in the
        background); when none does, the exact one, whose compile the step waits for.
        -> (bucket, whether it is only lent to the step)."""
        dynamic = SamplerPlan.DYNAMIC
        exact = self.buckets.select(num_tokens, num_seqs)
        if self._compiled.get((exact, kind, dynamic)) is not None:
            return exact, False
        decode_only = kind in ("window", "ahead")
        for bucket in self.buckets.fitting(num_tokens, num_seqs, decode_only=decode_only):
            if self._compiled.get((bucket, kind, dynamic)) is not None:
                self._compiled.compile_in_background([(exact, kind, dynamic)])
                return bucket, True
        return exact, False

    def _decode_shapes(self, num_seqs: int) -> list[Shape]:
        """The shapes that decode steps of `num_seqs` sequences will run in."""
        bucket = self.buckets.select(num_seqs, num_seqs)
        kinds = ["step"]
        if self.num_scheduler_steps > 1:
            kinds.append("window")
        if self.async_scheduling:
            kinds.append("ahead")
        return [(bucket, kind, SamplerPlan.DYNAMIC) for kind in kinds]

    def _warm_up(self, bucket: Bucket) -> None:
        """Run `bucket` once on an all-padding step, which writes only the null page.

        XLA:CPU sets up each fused kernel of an executable on its first call, with a persistent
        cache too: 0.4-0.9 s a SmolLM2 bucket with the layers unrolled, up to 0.3 s with the
        layer scan, that the first real step of each shape would otherwise add to a request. One padding query of each tile group
        reads the null page's first position, so that the page loops run too. The run is only
        dispatched: it executes while other buckets compile (`warmup_seconds` counts the
        dispatch and compile_all's final wait, i.e. what the runs add to start-up).
        """
        start = time.perf_counter()
        dummy = self._padding_step(bucket)
        for tiles in dummy.attn.tiles:  # padding token 0, in every group: its output is dropped
            tiles.kv_lens[0, 0] = 1
        _, self.kv_cache, self.token_cache = self._executable(bucket)(
            self.params, self.kv_cache, self.token_cache, self.bias_rows.rows, dummy
        )
        self.warmup_seconds += time.perf_counter() - start

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        block_ids: list[list[int]],
        token_bitmask: np.ndarray | None = None,
    ) -> ModelRunnerOutput:
        """Run one scheduled step: the sampled token of every scheduled request, in order, and
        the logprobs that any of them asked for; a decode window's tokens as a list each.
        `token_bitmask`: the requests' grammar masks (structured outputs), None for none."""
        # The decode steps that follow this one: their compiles start now, beside this step's.
        requests = scheduler_output.scheduled_requests
        self._compiled.compile_in_background(self._decode_shapes(len(requests)))
        num_reqs = len(requests)
        counts = [scheduler_output.num_scheduled_tokens[r.request_id] for r in requests]
        is_window = scheduler_output.num_steps > 1
        bias_slots = self.bias_rows.slots_for(requests)
        adapter_slots = self.adapter_slots_for(requests)
        start = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        rows = rows_ahead(ahead, scheduler_output, block_ids, self.bias_rows.num_sends)
        used_ahead = rows is not None
        if used_ahead:  # the step is already on the device
            self.num_steps_ahead_used += 1
            bucket, out, inputs = ahead.bucket, ahead.out, ahead.inputs
            any_logprobs, plan = ahead.any_logprobs, ahead.plan
        else:
            self.num_steps_ahead_dropped += ahead is not None
            rows = list(range(num_reqs))
            kind = "window" if is_window else "step"
            bucket, lent = self._select_bucket(sum(counts), num_reqs, kind)
            inputs = prepare_step_inputs(
                requests,
                counts,
                block_ids,
                bucket,
                self.block_size,
                self.max_pages,
                self.config.vocab_size,
                bias_slots,
                token_bitmask,
                adapter_slots,
            )
            any_logprobs, plan = bool(inputs.sampling.any_logprobs), self._plan(inputs)
            if lent:
                plan = SamplerPlan.DYNAMIC  # no plan compiles for a bucket only lent
            args = [self.params, self.kv_cache, self.token_cache, self.bias_rows.rows, inputs]
            if is_window:
                limits = [scheduler_output.window_limits[r.request_id] for r in requests]
                args.append(prepare_window_inputs(requests, limits, bucket.num_seqs))
            exe = self._executable(bucket, kind, plan)
            out, self.kv_cache, self.token_cache = exe(*args)
        if (
            self.async_scheduling
            and can_run_ahead(scheduler_output, block_ids, self.block_size)
            and self._compiled.get((bucket, "ahead", SamplerPlan.DYNAMIC)) is not None
        ):
            self._run_ahead(
                scheduler_output, block_ids, rows, bucket, any_logprobs, plan, out, inputs
            )
        dispatched = time.perf_counter()
        # A window and a step run ahead decode only: no prompt positions to score.
        any_prompt_logprobs = not (is_window or used_ahead) and bool(
            inputs.sampling.any_prompt_logprobs
        )
        result = fetch_output(out, rows, is_window, any_logprobs, any_prompt_logprobs)
        self.dispatch_seconds += dispatched - start
        self.device_wait_seconds += time.perf_counter() - dispatched
        return result

    def execute_pooling(
        self, scheduler_output: SchedulerOutput, block_ids: list[list[int]]
    ) -> np.ndarray:
        """Run one scheduled step of a pooling runner: f32[num_reqs, D], row i request i's
        chunk's share of its pooled vector (worker/pooler.py)."""
        requests = scheduler_output.scheduled_requests
        counts = [scheduler_output.num_scheduled_tokens[r.request_id] for r in requests]
        bucket, _ = self._select_bucket(sum(counts), len(requests), "pool")
        layout = (bucket, self.block_size, self.max_pages, self.config.vocab_size)
        step = prepare_step_inputs(requests, counts, block_ids, *layout)
        inputs = prepare_pool_inputs(step, requests, counts, self.pooling_type)
        exe = self._executable(bucket, "pool")
        pooled, self.kv_cache = exe(self.params, self.kv_cache, inputs)
        return np.asarray(pooled)[: len(requests)]

    def _run_ahead(
        self,
        scheduler_output: SchedulerOutput,
        block_ids: list[list[int]],
        rows: list[int],
        bucket: Bucket,
        any_logprobs: bool,
        plan: SamplerPlan,
        out,
        inputs: StepInputs,
    ) -> None:
        """Dispatch the decode step after this one, its `rows` (this step's requests) fed this
        step's tokens on the device; every other row stays inactive."""
        active = np.zeros(bucket.num_seqs, bool)
        active[rows] = True
        # The step's sampling metadata but for its output index: this step's plan.
        exe = self._executable(bucket, "ahead", plan)
        out, next_inputs, self.kv_cache, self.token_cache = exe(
            self.params,
            self.kv_cache,
            self.token_cache,
            self.bias_rows.rows,
            inputs,
            out.sampled_token_ids,
            active,
        )
        request_ids: list[str | None] = [None] * bucket.num_seqs
        row_blocks: list[list[int]] = [[] for _ in range(bucket.num_seqs)]
        for row, request, blocks in zip(rows, scheduler_output.scheduled_requests, block_ids):
            request_ids[row], row_blocks[row] = request.request_id, blocks
        self._ahead = StepAhead(
            request_ids=tuple(request_ids),
            block_ids=row_blocks,
            num_bias_sends=self.bias_rows.num_sends,
            bucket=bucket,
            any_logprobs=any_logprobs,
            plan=plan,
            out=out,
            inputs=next_inputs,
        )


def _describe(bucket: Bucket, kind: str, plan: SamplerPlan, num_steps: int) -> str:
    """A shape's name in log lines; every executable gets its own."""
    plan_name = "" if plan is SamplerPlan.DYNAMIC else f", {plan.value} sampling"
    if not bucket.is_decode:
        return f"mixed bucket (tokens={bucket.num_tokens}, seqs={bucket.num_seqs}){plan_name}"
    what = f"decode bucket (seqs={bucket.num_seqs})"
    if kind == "window":
        return f"{what}, {num_steps}-step window{plan_name}"
    return f"{what}{', run ahead' if kind == 'ahead' else ''}{plan_name}"
