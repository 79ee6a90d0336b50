"""The model runner: owns the parameters, the paged KV array and every `jax.jit` entry point
(`_jitted`'s steps, the bias table's and the LoRA slots' updates), and runs the steps; which
executables exist and when each compiles is its StepCompiler's (step_compiler.py)."""

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.attention.backends import get_attention, in_kv_groups
from jvllm.attention.reference import pages_per_chunk
from jvllm.config import ModelConfig
from jvllm.core.engine_config import RunnerConfig
from jvllm.core.kv_groups import KVCacheGroups
from jvllm.core.request import Request
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.distributed.mesh import TP_AXIS, make_mesh, replicated
from jvllm.distributed.sharded_model import KV_CACHE_SPEC, sharded_model
from jvllm.layers.scan import unstack_layers, use_unstacked_layers
from jvllm.logger import init_logger
from jvllm.lora.slots import AdapterSlots, update_columns, with_slot_params
from jvllm.models.model import image_num_embeds, num_moe_layers, param_axes, takes_images
from jvllm.sample.plan import SamplerPlan, use_sampler_plans
from jvllm.worker.async_step import StepAhead, can_run_ahead, next_decode_step, rows_ahead
from jvllm.worker.bias_rows import BiasRows, set_row
from jvllm.worker.buckets import MIXED_TILE_Q, SPECULATIVE_MIN_TOKENS, Bucket, BucketSpec
from jvllm.worker.decode_loop import (
    prepare_window_inputs,
    run_window,
    window_steps_per_check,
)
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.draft_scoring import with_accepted_runs
from jvllm.worker.drafters import make_drafter
from jvllm.worker.encoder_runner import EncoderRunner
from jvllm.worker.kv_layout import allocate_kv_cache, kv_cache_shape, kv_cache_spec
from jvllm.worker.pooler import pool_step, prepare_pool_inputs
from jvllm.worker.runner_output import ModelRunnerOutput, fetch_output
from jvllm.worker.spec_window import (
    SpecWindowOutput,
    cut_short,
    fetch_spec_window,
    first_round,
    run_spec_window,
)
from jvllm.worker.step_compiler import StepCompiler, StepLayout, abstract_state
from jvllm.worker.step_fn import model_step, single_step
from jvllm.worker.step_inputs import StepInputs, prepare_step_inputs, window_block_ids

logger = init_logger(__name__)


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
        max_num_seqs = runner_config.max_num_seqs
        attention_backend = runner_config.attention_backend
        num_speculative_tokens = runner_config.num_speculative_tokens
        pooling_type = runner_config.pooling_type
        buckets = BucketSpec(
            runner_config.max_num_batched_tokens,
            max_num_seqs,
            **({"min_mixed_tokens": SPECULATIVE_MIN_TOKENS} if num_speculative_tokens else {}),
        )
        self.config = config
        self.mesh = mesh = mesh or make_mesh()
        self.adapters = None
        if config.max_loras:
            params = with_slot_params(params, config, mesh)
            update = jax.jit(update_columns, static_argnums=3)
            self.adapters = AdapterSlots(
                config, runner_config.max_cpu_loras, update, mesh.shape[TP_AXIS]
            )
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
        max_blocks = math.ceil(runner_config.max_model_len / block_size)
        self.max_pages = math.ceil(max_blocks / chunk) * chunk
        self.kv_cache = allocate_kv_cache(
            kv_cache_spec(config.dtype, attention_backend, runner_config.kv_cache_dtype),
            kv_cache_shape(
                config, num_blocks, block_size, num_shards, kv_groups and kv_groups.num_slots
            ),
            NamedSharding(mesh, KV_CACHE_SPEC),
        )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup = runner_config.prompt_lookup
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
            max_num_seqs + 1, config.vocab_size, self._set_bias_row, replicated(mesh)
        )
        self.max_logprobs = max_logprobs = runner_config.max_logprobs
        # Gemma 3: image tokens attend to their whole image (attention/image_ahead.py).
        self.bidirectional_images = bool(config.option("bidirectional_images"))
        attn = get_attention(
            attention_backend,
            sm_scale=config.sm_scale,
            logit_softcap=config.attn_logit_softcap,
            max_image_tokens=image_num_embeds(config) if self.bidirectional_images else 0,
            latent_dim=config.option("kv_lora_rank") if config.kv_planes == 1 else None,
        )
        # Hybrid KV groups: each step carries every group's tables.
        self.num_kv_groups = kv_groups.num_groups if kv_groups else 1
        if self.num_kv_groups > 1:
            attn = in_kv_groups(attn, kv_groups)
        # The step body as a pure function of (params, kv_cache, token_cache, bias_rows,
        # inputs), statics bound: the decode windows and jvllm.step_loop chain it.
        self.model = sharded_model(config, mesh, attn, self.layers_unstacked, self.params)
        self.step = functools.partial(
            model_step,
            model=self.model,
            max_logprobs=max_logprobs,
            logprobs_mode=runner_config.logprobs_mode,
            num_drafts=num_speculative_tokens,
            **(self.draft.step_options if self.draft is not None else {}),
        )
        # Decode windows: one more executable per decode bucket, for up to k steps a call.
        self.num_scheduler_steps = num_scheduler_steps = runner_config.num_scheduler_steps
        self.window_steps_per_check = window_steps_per_check()
        # Async scheduling: one more executable per decode bucket, the step after a step.
        self.async_scheduling = async_scheduling = runner_config.async_scheduling
        # On a GPU, a step runs the executable of its sampler plan once that is compiled (in
        # the background, on the plan's first step) and the DYNAMIC one until then.
        self.sampler_plans = use_sampler_plans()
        self._ahead: StepAhead | None = None
        self.num_steps_ahead_used = 0
        self.num_steps_ahead_dropped = 0
        # A model that takes images: its encoder and the images' embeddings.
        self.encoder = EncoderRunner(config) if takes_images(config) else None
        if self.encoder and self.draft and num_scheduler_steps > 1:
            raise ValueError(
                "num_scheduler_steps > 1 with a speculative_config does not run for a model that "
                "takes images yet (its rounds would move the images' rotary positions): use "
                "num_scheduler_steps=1"
            )
        # A model with routed experts: each MoE layer's (token, expert) assignments so far,
        # i64[L_moe, E] (row i: layer num_layers - L_moe + i), from each step's counts; a new
        # array each step, so a reader on another thread holds a consistent one.
        self.expert_token_counts = (
            np.zeros((num_moe_layers(config), config.num_experts), np.int64)
            if self.model.forward_counting_experts
            else None
        )
        # What every executable is lowered for, fixed once the arrays exist.
        self._state_spec = abstract_state(
            (self.params, self.kv_cache, self.token_cache, self.bias_rows.rows)
        )
        self.compiler = StepCompiler(
            buckets,
            (self._step_params(), *self._state_spec[1:]),
            self._jitted,
            StepLayout(
                block_size,
                self.max_pages,
                config.vocab_size,
                has_adapters=self.adapters is not None,
                num_speculative_tokens=num_speculative_tokens,
                num_kv_groups=self.num_kv_groups,
                image_embeds=(
                    (config.hidden_size, config.dtype, self.encoder.has_rope_positions)
                    if self.encoder
                    else None
                ),
                has_image_groups=self.bidirectional_images,
            ),
            pooling_type=pooling_type,
            num_scheduler_steps=num_scheduler_steps,
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
        step = functools.partial(self.step, plan=plan)
        counts = self.expert_token_counts
        # A window of steps or rounds sums its expert counts: (L_moe, E), or None without.
        counts_shape = None if counts is None else counts.shape
        if kind == "window":
            fn = functools.partial(
                run_window,
                step=step,
                num_steps=self.num_scheduler_steps,
                steps_per_check=self.window_steps_per_check,
                max_logprobs=self.max_logprobs,
                expert_counts_shape=counts_shape,
            )
        elif kind == "spec_window":
            fn = functools.partial(
                run_spec_window,
                step=step,
                num_rounds=self.num_scheduler_steps,
                num_drafts=self.num_speculative_tokens,
                max_logprobs=self.max_logprobs,
                rounds_per_check=min(self.window_steps_per_check, self.num_scheduler_steps),
                expert_counts_shape=counts_shape,
                prompt_lookup=self.prompt_lookup,
            )
        elif kind == "ahead":
            fn = functools.partial(next_decode_step, step=step)
        else:
            fn = functools.partial(single_step, step=step)
        return jax.jit(fn, donate_argnums=(1, 2))

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
        ids = [r.lora_request.lora_int_id if r.lora_request else None for r in requests]
        return self.adapters.slots_for(self.params, ids)

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
        num_reqs = len(requests)
        counts = [scheduler_output.num_scheduled_tokens[r.request_id] for r in requests]
        is_window = scheduler_output.num_steps > 1
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
            rows = list(range(num_reqs))
            drafts = scheduler_output.spec_token_ids
            draft_lists = [drafts.get(r.request_id, []) for r in requests] if drafts else None
            kind = "window" if is_window else "step"
            if is_window and self.num_speculative_tokens:
                kind = "spec_window"
                draft_lists, counts = first_round(
                    draft_lists, num_reqs, self.num_speculative_tokens
                )
            bucket, lent = self.compiler.select_bucket(sum(counts), num_reqs, kind)
            draft_bitmask = None
            if token_bitmask is not None and len(token_bitmask) > num_reqs:
                token_bitmask, draft_bitmask = token_bitmask[:num_reqs], token_bitmask[num_reqs:]
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
                draft_lists,
                self.num_speculative_tokens,
                self.num_kv_groups,
                window_block_ids(scheduler_output),
                draft_bitmask,
            )
            if self.encoder is not None:
                inputs = self.encoder.with_images(inputs, requests, counts)
            any_logprobs, plan = bool(inputs.sampling.any_logprobs), self.compiler.plan(inputs)
            if lent:
                plan = SamplerPlan.DYNAMIC  # no plan compiles for a bucket only lent
            args = [self._step_params(), self.kv_cache, self.token_cache, self.bias_rows.rows]
            args.append(inputs)
            if is_window:
                limits = [scheduler_output.window_limits[r.request_id] for r in requests]
                args.append(prepare_window_inputs(requests, limits, bucket.num_seqs))
            exe = self.compiler.executable(bucket, kind, plan)
            out, self.kv_cache, self.token_cache = exe(*args)
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
        any_prompt_logprobs = not (is_window or used_ahead) and bool(
            inputs.sampling.any_prompt_logprobs
        )
        if isinstance(out, SpecWindowOutput):
            result = fetch_spec_window(out, num_reqs, any_logprobs)
            if self.draft is not None:  # n-gram drafts: the host looks the next ones up
                self.draft.drop_drafts(cut_short(result, requests))
        else:
            result = fetch_output(out, rows, is_window, any_logprobs, any_prompt_logprobs)
        if self.expert_token_counts is not None:
            self.expert_token_counts = self.expert_token_counts + np.asarray(out.expert_counts)
        if scheduler_output.spec_token_ids and not is_window:  # each request's run, a list
            drafts = [scheduler_output.spec_token_ids.get(r.request_id, []) for r in requests]
            result = with_accepted_runs(result, out, drafts)
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
        bucket, _ = self.compiler.select_bucket(sum(counts), len(requests), "pool")
        layout = (bucket, self.block_size, self.max_pages, self.config.vocab_size)
        step = prepare_step_inputs(
            requests,
            counts,
            block_ids,
            *layout,
            num_kv_groups=self.num_kv_groups,
            window_block_ids=window_block_ids(scheduler_output),
        )
        inputs = prepare_pool_inputs(step, requests, counts, self.pooling_type)
        exe = self.compiler.executable(bucket, "pool")
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
