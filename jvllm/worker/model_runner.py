"""The model runner: owns the parameters, the paged KV array and every `jax.jit` entry point
(`_jitted`'s steps, the bias table's and the LoRA slots' updates), and runs the steps; which
executables exist and when each compiles is its StepCompiler's (step_compiler.py), the shapes
they are lowered for step_layout.py's, what each kind chains step_kinds.py's, and how a
schedule becomes an executable's arguments and its outputs the requests' results
scheduled_step.py's."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jvllm.config import ModelConfig
from jvllm.core.engine_config import RunnerConfig
from jvllm.core.kv_groups import KVCacheGroups
from jvllm.core.request import Request
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.distributed.mesh import TP_AXIS, make_mesh, replicated
from jvllm.distributed.sharded_model import KV_CACHE_SPEC, sharded_model
from jvllm.layers.scan import unstack_layers, use_unstacked_layers
from jvllm.lora.slots import AdapterSlots, update_columns, with_slot_params
from jvllm.models.model import num_moe_layers, param_axes, takes_images
from jvllm.sample.plan import SamplerPlan, use_sampler_plans
from jvllm.worker.async_step import StepAhead, can_run_ahead, rows_ahead
from jvllm.worker.bias_rows import BiasRows, set_row
from jvllm.worker.buckets import Bucket
from jvllm.worker.decode_loop import window_steps_per_check
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.drafters import make_drafter
from jvllm.worker.encoder_runner import EncoderRunner
from jvllm.worker.kv_layout import new_kv_cache
from jvllm.worker.pooler import pool_step
from jvllm.worker.runner_output import ModelRunnerOutput
from jvllm.worker.scheduled_step import prepare_pool_step, prepare_step, read_results
from jvllm.worker.spec_window import cut_short
from jvllm.worker.step_compiler import StepCompiler, abstract_state
from jvllm.worker.step_fn import model_step
from jvllm.worker.step_inputs import StepInputs
from jvllm.worker.step_kinds import StepKinds
from jvllm.worker.step_layout import step_attention, step_buckets, step_layout


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params,
        runner_config: RunnerConfig,
        *,
        num_blocks: int,
        mesh: Mesh | None = None,
        kv_groups: KVCacheGroups | None = None,
        draft: DraftModel | None = None,
    ):
        """`params` already lie on `mesh` (the loaders place them); None: JAX's default
        device. Every array the runner makes lies on the same devices. A `runner_config` with
        a `pooling_type` (pooler_config.py): its steps pool (`execute_pooling`), never sample.
        A `config` with max_loras > 0 serves LoRA adapters (jvllm/lora/): `params` are the
        base model's, and the runner adds the empty slots. `num_speculative_tokens` > 0: every
        "step" executable also scores the drafts' positions (worker/draft_scoring.py).
        `kv_groups`: the layers' KV groups (core/kv_groups.py); None: one group of all.
        `draft`: speculative decoding's draft model (worker/draft_model.py), its params on
        `mesh`; its KV cache is allocated here over the same pages."""
        if runner_config.max_model_len is None or runner_config.attention_backend is None:
            raise ValueError("the runner takes a config the worker resolved (Worker.config)")
        block_size = runner_config.block_size
        attention_backend = runner_config.attention_backend
        num_speculative_tokens = runner_config.num_speculative_tokens
        self.config = config
        self.mesh = mesh = mesh or make_mesh()
        self.adapters = None
        if config.max_loras:
            params = with_slot_params(params, config, mesh)
            update = jax.jit(update_columns, static_argnums=3)
            self.adapters = AdapterSlots(
                config, runner_config.max_cpu_loras, update, mesh.shape[TP_AXIS]
            )
        # On a GPU the layers' weights as one array per layer (layers/scan.py): the caller's
        # stacked arrays are deleted as they are split.
        self.layers_unstacked = use_unstacked_layers()
        if self.layers_unstacked:
            params = unstack_layers(params, param_axes(config))
        self.params = params
        # A model that takes images: its encoder and the images' embeddings.
        self.encoder = EncoderRunner(config) if takes_images(config) else None
        if self.encoder and draft is not None and runner_config.num_scheduler_steps > 1:
            raise ValueError(
                "num_scheduler_steps > 1 with a speculative_config does not run for a model that "
                "takes images yet (its rounds would move the images' rotary positions): use "
                "num_scheduler_steps=1"
            )
        self.block_size = block_size
        self.buckets = buckets = step_buckets(runner_config)
        layout = step_layout(config, runner_config, kv_groups, self.encoder)
        self.max_pages, self.num_kv_groups = layout.max_pages, layout.num_kv_groups
        self.attention_backend = attention_backend
        self.kv_cache = new_kv_cache(
            config,
            mesh,
            KV_CACHE_SPEC,
            num_blocks=num_blocks,
            block_size=block_size,
            attention_backend=attention_backend,
            kv_cache_dtype=runner_config.kv_cache_dtype,
            num_slots=kv_groups and kv_groups.num_slots,
        )
        self.draft = None
        if draft is not None:  # the runner's kv_cache becomes the pair (target's, draft's)
            self.draft = make_drafter(
                draft,
                config,
                mesh,
                layers_unstacked=self.layers_unstacked,
                num_blocks=num_blocks,
                block_size=block_size,
                attention_backend=attention_backend,
                kv_cache_dtype=runner_config.kv_cache_dtype,
                num_speculative_tokens=num_speculative_tokens,
            )
            self.kv_cache = (self.kv_cache, self.draft.kv_cache)
        self.token_cache = jnp.zeros(
            (num_blocks, block_size), jnp.int32, device=replicated(mesh)
        )  # [P, B]
        self._set_bias_row = jax.jit(set_row, donate_argnums=0)
        # One row per running request at most, plus the shared zero row.
        self.bias_rows = BiasRows(
            runner_config.max_num_seqs + 1, config.vocab_size, self._set_bias_row, replicated(mesh)
        )
        # The step body as a pure function of (params, kv_cache, token_cache, bias_rows,
        # inputs), statics bound: the decode windows and jvllm.step_loop chain it.
        attn = step_attention(config, layout, attention_backend, kv_groups)
        self.model = sharded_model(config, mesh, attn, self.layers_unstacked, self.params)
        self.step = functools.partial(
            model_step,
            model=self.model,
            max_logprobs=runner_config.max_logprobs,
            logprobs_mode=runner_config.logprobs_mode,
            num_drafts=num_speculative_tokens,
            **(self.draft.step_options if self.draft is not None else {}),
        )
        # Async scheduling: one more executable per decode bucket, the step after a step.
        self.async_scheduling = async_scheduling = runner_config.async_scheduling
        # On a GPU, a step runs the executable of its sampler plan once that is compiled (in
        # the background, on the plan's first step) and the DYNAMIC one until then.
        self.sampler_plans = use_sampler_plans()
        self._ahead: StepAhead | None = None
        self.num_steps_ahead_used = 0
        self.num_steps_ahead_dropped = 0
        # A model with routed experts: each MoE layer's (token, expert) assignments so far,
        # i64[L_moe, E] (row i: layer num_layers - L_moe + i), from each step's counts; a new
        # array each step, so a reader on another thread holds a consistent one.
        self.expert_token_counts = (
            np.zeros((num_moe_layers(config), config.num_experts), np.int64)
            if self.model.forward_counting_experts
            else None
        )
        # Decode windows: one more executable per decode bucket, for up to k steps a call.
        counts_shape = None if self.expert_token_counts is None else self.expert_token_counts.shape
        self._kinds = StepKinds(runner_config, window_steps_per_check(), counts_shape)
        # What every executable is lowered for, fixed once the arrays exist.
        self._state_spec = abstract_state(
            (self.params, self.kv_cache, self.token_cache, self.bias_rows.rows)
        )
        self.compiler = StepCompiler(
            buckets,
            (self._step_params(), *self._state_spec[1:]),
            self._jitted,
            layout,
            pooling_type=runner_config.pooling_type,
            num_scheduler_steps=runner_config.num_scheduler_steps,
            async_scheduling=async_scheduling,
            sampler_plans=self.sampler_plans,
            lockstep=jax.process_count() > 1,  # every process's steps must be the same
        )
        if self.draft is not None and self.draft.reads_layer_inputs:
            # A target whose layers expose no inputs to an EAGLE-3 head raises when its step is
            # traced (layers/hidden_capture.py): once now, not at every request's step.
            bucket = min(buckets.all_buckets(), key=lambda b: b.num_tokens)
            args = (self._step_params(), self.kv_cache, self.token_cache, self.bias_rows.rows)
            jax.eval_shape(self.step, *args, self.compiler.padding_step(bucket))
        self.warmup_seconds = 0.0
        # Where execute_model's time goes: calling the executable until it returns (argument
        # handling and host-to-device copies; on CPU the computation too, which XLA:CPU runs
        # inline for small steps), then waiting for the results (on a GPU, the device time
        # that the host's work did not hide).
        self.dispatch_seconds = 0.0
        self.device_wait_seconds = 0.0

    def _step_params(self):
        """The params argument of the step executables: the target's, or (target's,
        draft's) with a draft model."""
        return self.params if self.draft is None else (self.params, self.draft.params)

    def propose_drafts(
        self, requests: list[Request], block_ids: list[list[int]]
    ) -> dict[str, tuple[int, list[int]]]:
        """The drafts the last step proposed for `requests`, which will decode next
        (ProposalRunner.propose)."""
        return self.draft.propose(requests, block_ids)

    def _jitted(self, kind: str, plan: SamplerPlan):
        """The jitted entry point of a kind of executable, its sampler plan bound."""
        if kind == "pool":
            pool = functools.partial(pool_step, forward=self.model.forward)
            return jax.jit(pool, donate_argnums=1)
        body = self._kinds.body(kind, functools.partial(self.step, plan=plan))
        return jax.jit(body, donate_argnums=(1, 2))

    def compile_all(self, progress: bool = True) -> float:
        """Compile every shape up front so that nothing compiles while serving but sampler
        plans' executables (sample/plan.py), two at a time;
        -> the seconds spent compiling. Each bucket's warm-up run is dispatched as soon as it
        is ready and executes alongside the compiles (`warmup_seconds` counts the dispatches
        and the wait for the last runs)."""
        start = time.perf_counter()
        self.compiler.compile_all(progress, self._warm_up)
        self._compile_set_bias_row()
        compiled = time.perf_counter()
        jax.block_until_ready(self.kv_cache)  # the warm-up runs are chained through the cache
        self.warmup_seconds += time.perf_counter() - compiled
        return compiled - start

    def compile_in_background(self) -> None:
        """Queue every shape, cheapest first, to compile in background threads (see
        StepCompiler.compile_in_background). Nothing warms these up (see _warm_up): the threads
        must not touch the donated arrays, and with the layer scan a first call costs at most a
        few tenths of a second more."""
        self._compile_set_bias_row()
        self.compiler.compile_in_background()

    def _compile_set_bias_row(self) -> None:
        rows = self.bias_rows.rows
        self._set_bias_row.lower(rows, np.int32(0), np.zeros(rows.shape[1], np.float32)).compile()

    def _warm_up(self, bucket: Bucket) -> None:
        """Run `bucket` once on an all-padding step, which writes only the null page.

        XLA:CPU sets up each fused kernel of an executable on its first call, with a persistent
        cache too: 0.4-0.9 s a SmolLM2 bucket with the layers unrolled, up to 0.3 s with the
        layer scan, that the first real step of each shape would otherwise add to a request.
        One padding query of each tile group reads the null page's first position, so that the
        page loops run too. The run is only dispatched: it executes while other buckets compile
        (`warmup_seconds` counts the dispatch and compile_all's final wait, i.e. what the runs
        add to start-up).
        """
        start = time.perf_counter()
        dummy = self.compiler.padding_step(bucket)
        for tiles in dummy.attn.tiles:  # padding token 0, in every group: its output is dropped
            tiles.kv_lens[0, 0] = 1
        _, self.kv_cache, self.token_cache = self.compiler.executable(bucket)(
            self._step_params(), self.kv_cache, self.token_cache, self.bias_rows.rows, dummy
        )
        self.warmup_seconds += time.perf_counter() - start

    def adapter_slots_for(self, requests) -> np.ndarray | None:
        """Each request's LoRA slot (-1: none), its adapter put in one first; None where the
        engine serves no adapters."""
        if self.adapters is None:
            return None
        return self.adapters.slots_of_requests(self.params, requests)

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        block_ids: list[list[int]],
        token_bitmask: np.ndarray | None = None,
    ) -> ModelRunnerOutput:
        """Run one scheduled step: the sampled token of every scheduled request, in order, and
        the logprobs that any of them asked for; a decode window's tokens as a list each.
        `token_bitmask`: the requests' grammar masks (structured outputs), then, with drafts,
        their positions' (StructuredOutputManager.bitmask); None for none."""
        # The decode steps that follow this one: their compiles start now, beside this step's.
        requests = scheduler_output.scheduled_requests
        self.compiler.queue_decode_shapes(len(requests))
        bias_slots = self.bias_rows.slots_for(requests)
        adapter_slots = self.adapter_slots_for(requests)
        if self.encoder is not None:
            self.encoder.run(self.params, scheduler_output)
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
            rows = list(range(len(requests)))
            step = prepare_step(
                self.compiler,
                self.encoder,
                scheduler_output,
                block_ids,
                bias_slots,
                adapter_slots,
                token_bitmask,
            )
            bucket, inputs, plan = step.bucket, step.inputs, step.plan
            any_logprobs = bool(inputs.sampling.any_logprobs)
            exe = self.compiler.executable(bucket, step.kind, plan)
            state = (self._step_params(), self.kv_cache, self.token_cache, self.bias_rows.rows)
            out, self.kv_cache, self.token_cache = exe(*state, *step.args)
            if self.draft is not None:
                self.draft.keep_drafts(out.draft_tokens, requests)
        if (
            self.async_scheduling
            and can_run_ahead(scheduler_output, block_ids, self.block_size)
            and self.compiler.is_ready(bucket, "ahead")
        ):
            self._run_ahead(
                scheduler_output, block_ids, rows, bucket, any_logprobs, plan, out, inputs
            )
        dispatched = time.perf_counter()
        # A window and a step run ahead decode only: no prompt positions to score.
        is_window = scheduler_output.num_steps > 1
        any_prompt_logprobs = not (is_window or used_ahead) and bool(
            inputs.sampling.any_prompt_logprobs
        )
        result = read_results(out, scheduler_output, rows, any_logprobs, any_prompt_logprobs)
        if result.round_drafts is not None and self.draft is not None:
            # A window of rounds: its drafts past a run it cut short go (n-gram drafts: the
            # host looks the next ones up).
            self.draft.drop_drafts(cut_short(result, requests))
        if self.expert_token_counts is not None:
            self.expert_token_counts = self.expert_token_counts + np.asarray(out.expert_counts)
        self.dispatch_seconds += dispatched - start
        self.device_wait_seconds += time.perf_counter() - dispatched
        return result

    def execute_pooling(
        self, scheduler_output: SchedulerOutput, block_ids: list[list[int]]
    ) -> np.ndarray:
        """Run one scheduled step of a pooling runner: f32[num_reqs, D], row i request i's
        chunk's share of its pooled vector (worker/pooler.py)."""
        bucket, inputs = prepare_pool_step(self.compiler, scheduler_output, block_ids)
        exe = self.compiler.executable(bucket, "pool")
        pooled, self.kv_cache = exe(self.params, self.kv_cache, inputs)
        return np.asarray(pooled)[: len(scheduler_output.scheduled_requests)]

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
        exe = self.compiler.executable(bucket, "ahead", plan)
        out, next_inputs, self.kv_cache, self.token_cache = exe(
            self.params,
            self.kv_cache,
            self.token_cache,
            self.bias_rows.rows,
            inputs,
            out.sampled_token_ids,
            active,
        )
        self._ahead = StepAhead.of_rows(
            rows,
            scheduler_output.scheduled_requests,
            block_ids,
            num_bias_sends=self.bias_rows.num_sends,
            bucket=bucket,
            any_logprobs=any_logprobs,
            plan=plan,
            out=out,
            inputs=next_inputs,
        )
