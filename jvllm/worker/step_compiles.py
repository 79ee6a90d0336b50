"""Which executables a model runner has and when each compiles: the step shapes (bucket, kind,
sampler plan), compiling them up front or in background threads, the bucket a step runs in
while its own is not compiled yet, and the warm-up runs. ModelRunner (model_runner.py) takes
these methods; the jit entry points they compile stay there (its `_jitted`)."""

import time

import jax
import numpy as np

from jvllm.sample.plan import SamplerPlan, choose_plan
from jvllm.worker.buckets import Bucket
from jvllm.worker.decode_loop import prepare_window_inputs
from jvllm.worker.pooler import prepare_pool_inputs
from jvllm.worker.step_inputs import StepInputs, prepare_step_inputs

Shape = tuple[Bucket, str, SamplerPlan]  # (bucket, kind of executable, sampler plan)


class StepCompiles:
    """The compile side of ModelRunner, over its attributes: `_compiled` (an Executables),
    `buckets`, `params`, `kv_cache`, `token_cache`, `bias_rows`, `adapters`, `pooling_type`,
    `num_scheduler_steps`, `async_scheduling`, `num_speculative_tokens`, `sampler_plans` and
    `_jitted(kind, plan)`."""

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
            num_speculative_tokens=self.num_speculative_tokens,
        )

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


def describe_shape(bucket: Bucket, kind: str, plan: SamplerPlan, num_steps: int) -> str:
    """A shape's name in log lines; every executable gets its own."""
    plan_name = "" if plan is SamplerPlan.DYNAMIC else f", {plan.value} sampling"
    if not bucket.is_decode:
        return f"mixed bucket (tokens={bucket.num_tokens}, seqs={bucket.num_seqs}){plan_name}"
    what = f"decode bucket (seqs={bucket.num_seqs})"
    if kind == "window":
        return f"{what}, {num_steps}-step window{plan_name}"
    return f"{what}{', run ahead' if kind == 'ahead' else ''}{plan_name}"
