"""Which executables a model runner has and when each compiles: the step shapes (bucket, kind,
sampler plan), compiling them up front or in background threads, and the bucket a step runs in
while its own is not compiled yet. ModelRunner (model_runner.py) owns a StepCompiler, given
everything it reads; the jit entry points it compiles stay in the runner (the `jitted` factory),
and so do the arrays: the compiler lowers for their abstract spec and runs nothing."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.layers.image_embeds import ImageEmbeds
from jvllm.sample.plan import SamplerPlan, choose_plan
from jvllm.worker.buckets import Bucket, BucketSpec
from jvllm.worker.decode_loop import prepare_window_inputs
from jvllm.worker.executables import Executables
from jvllm.worker.pooler import prepare_pool_inputs
from jvllm.worker.step_inputs import StepInputs, prepare_step_inputs

Shape = tuple[Bucket, str, SamplerPlan]  # (bucket, kind of executable, sampler plan)


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """What a step's inputs hold besides its bucket (step_inputs.prepare_step_inputs): the
    compiler lowers each executable for a step of padding alone laid out so."""

    block_size: int
    max_pages: int
    vocab_size: int
    has_adapters: bool  # the inputs carry each sequence's LoRA slot
    num_speculative_tokens: int = 0  # > 0: every "step" also scores the drafts' positions
    num_kv_groups: int = 1  # > 1: the steps carry every hybrid KV group's tables
    # A model that takes images: its steps carry ImageEmbeds of (its width, dtype, whether with
    # M-RoPE positions); None: none.
    image_embeds: tuple[int, str, bool] | None = None
    has_image_groups: bool = False  # the attention metadata carries image_groups (Gemma 3)

    def inputs(
        self, requests, num_scheduled: list[int], block_ids, bucket: Bucket, **per_step
    ) -> StepInputs:
        """prepare_step_inputs for `requests`' `num_scheduled` tokens laid out so in `bucket`;
        `per_step`: its other arguments (bias slots, masks, drafts, adapter slots, ...)."""
        return prepare_step_inputs(
            requests,
            num_scheduled,
            block_ids,
            bucket,
            self.block_size,
            self.max_pages,
            self.vocab_size,
            num_speculative_tokens=self.num_speculative_tokens,
            num_kv_groups=self.num_kv_groups,
            **per_step,
        )


def abstract_state(arrays):
    """(params, kv_cache, token_cache, bias rows) as `jax.ShapeDtypeStruct`s: what every step
    is lowered for, by compiling threads too while warm-up runs donate the arrays."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), arrays
    )


class StepCompiler:
    def __init__(
        self,
        buckets: BucketSpec,
        state_spec,
        jitted: Callable[[str, SamplerPlan], Any],
        layout: StepLayout,
        *,
        pooling_type: str | None = None,
        num_scheduler_steps: int = 1,
        async_scheduling: bool = False,
        sampler_plans: bool = False,
        lockstep: bool = False,
    ):
        """`state_spec`: abstract_state of the runner's arrays. `jitted(kind, plan)`: the jitted
        entry point of a kind of executable ("step", "window", "spec_window", "ahead" or
        "pool"), its plan bound. `pooling_type` set: "pool" executables only; else "step", and
        "window" (with `num_scheduler_steps` > 1; "spec_window" with speculation too) and
        "ahead" (with `async_scheduling`) per decode bucket.
        `sampler_plans`: steps run their plan's executable once it is compiled (sample/plan.py).
        `lockstep`: one of several processes, which must run the same executables: nothing
        compiles in the background."""
        self.buckets = buckets
        self.state_spec = state_spec
        self._jitted = jitted
        self.layout = layout
        self.pooling_type = pooling_type
        self.num_scheduler_steps = num_scheduler_steps
        self.async_scheduling = async_scheduling
        self.sampler_plans = sampler_plans
        self.executables = Executables(
            self.compile,
            lambda shape: describe_shape(*shape, num_scheduler_steps),
            lockstep=lockstep,
        )

    @property
    def lockstep(self) -> bool:
        return self.executables.lockstep

    @property
    def num_compilations(self) -> int:
        return len(self.executables)

    @property
    def compile_seconds(self) -> float:
        """Every compile's own time, foreground or background."""
        return self.executables.compile_seconds

    @property
    def compile_wait_seconds(self) -> float:
        """The time steps waited for compiles: what compiling added to requests' latency."""
        return self.executables.wait_seconds

    def all_shapes(self) -> list[Shape]:
        """Every (bucket, kind, DYNAMIC) this runner can run: kind "step", "window" (a decode
        window), "spec_window" (one of speculative rounds) or "ahead" (the decode step after a
        step, for async scheduling). The other
        plans' executables compile when a step first asks for them."""
        buckets = self.buckets.all_buckets()
        if self.pooling_type is not None:
            return [(b, "pool", SamplerPlan.DYNAMIC) for b in buckets]
        shapes = [(b, "step") for b in buckets]
        if self.num_scheduler_steps > 1:
            shapes += self.buckets.window_shapes(self.layout.num_speculative_tokens)
        if self.async_scheduling:
            shapes += [(b, "ahead") for b in buckets if b.is_decode]
        return [(b, kind, SamplerPlan.DYNAMIC) for b, kind in shapes]

    def compile(self, shape: Shape) -> jax.stages.Compiled:
        """Lower `shape`'s entry point for the state spec and a step of padding; in any thread."""
        bucket, kind, plan = shape
        dummy = self.padding_step(bucket)
        args = [*self.state_spec, dummy]
        if kind == "pool":
            args = [*self.state_spec[:2], prepare_pool_inputs(dummy, [], [], self.pooling_type)]
        elif kind in ("window", "spec_window"):
            args.append(prepare_window_inputs([], [], bucket.num_seqs))
        elif kind == "ahead":
            args += [np.zeros(bucket.num_seqs, np.int32), np.zeros(bucket.num_seqs, bool)]
        return self._jitted(kind, plan).lower(*args).compile()

    def padding_step(self, bucket: Bucket) -> StepInputs:
        """A step of padding alone in `bucket`, for lowering and warm-up runs."""
        layout = self.layout
        adapter_slots = np.zeros(0, np.int32) if layout.has_adapters else None
        inputs = layout.inputs([], [], [], bucket, adapter_slots=adapter_slots)
        if layout.has_image_groups:
            groups = np.full(bucket.num_tokens, -1, np.int32)
            inputs = dataclasses.replace(
                inputs, attn=dataclasses.replace(inputs.attn, image_groups=groups)
            )
        if layout.image_embeds is None:
            return inputs
        width, dtype, has_rope_positions = layout.image_embeds
        t = bucket.num_tokens
        rope = np.zeros((3, t), np.int32) if has_rope_positions else None
        mm = ImageEmbeds(np.zeros((t, width), jnp.dtype(dtype)), np.zeros(t, bool), rope)
        return dataclasses.replace(inputs, mm=mm)

    def executable(
        self, bucket: Bucket, kind: str = "step", plan: SamplerPlan = SamplerPlan.DYNAMIC
    ) -> jax.stages.Compiled:
        """The executable of a step in `bucket`: its plan's once that is compiled; until then
        the DYNAMIC one, the plan's compiling in the background. A step compiles the plan's
        itself where it would compile the DYNAMIC one, and where nothing compiles in the
        background (in lockstep every process runs the same executables, so none can wait on
        a thread)."""
        dynamic = (bucket, kind, SamplerPlan.DYNAMIC)
        if plan is SamplerPlan.DYNAMIC:
            return self.executables.wait(dynamic)
        planned = (bucket, kind, plan)
        exe = self.executables.get(planned)
        if exe is not None:
            return exe
        exe = self.executables.get(dynamic)
        if exe is None or not self.executables.background:
            return self.executables.wait(planned)
        self.executables.compile_in_background([planned])
        return exe

    def is_ready(self, bucket: Bucket, kind: str) -> bool:
        """Whether the DYNAMIC executable of `kind` in `bucket` is compiled."""
        return self.executables.get((bucket, kind, SamplerPlan.DYNAMIC)) is not None

    def plan(self, inputs: StepInputs) -> SamplerPlan:
        return choose_plan(inputs.sampling) if self.sampler_plans else SamplerPlan.DYNAMIC

    def compile_all(self, progress: bool, warm_up: Callable[[Bucket], None]) -> None:
        """Compile every shape up front, two at a time; `warm_up(bucket)` runs in this thread
        as soon as each bucket's "step" executable is ready, while the others compile."""

        def on_ready(shape: Shape) -> None:
            bucket, kind, _ = shape
            if kind == "step":
                warm_up(bucket)

        self.executables.compile_now(self.all_shapes(), progress, on_ready)

    def compile_in_background(self) -> None:
        """Queue every shape, cheapest first, to compile in background threads: steps run
        meanwhile, in the smallest compiled bucket that holds them, or wait for their own."""
        kind_order = {"step": 0, "pool": 0, "window": 1, "spec_window": 1, "ahead": 2}
        self.executables.compile_in_background(
            sorted(
                self.all_shapes(), key=lambda s: (s[0].num_tokens, s[0].tile_q, kind_order[s[1]])
            )
        )

    def wait_for_compiles(self) -> None:
        """Return when every queued background compile is done."""
        self.executables.wait_all()

    def cancel_compiles(self) -> None:
        """Drop the queued background compiles (running ones finish); a later step that needs
        one of their shapes compiles it then."""
        self.executables.cancel_queued()

    def select_bucket(self, num_tokens: int, num_seqs: int, kind: str) -> tuple[Bucket, bool]:
        """The smallest bucket for the step; while its executable is not compiled, the
        smallest compiled one that holds the step (the exact one then compiles in the
        background); when none does, the exact one, whose compile the step waits for.
        Without background compiles a decode step is lent decode buckets only: a lent bucket
        is then the step's for good, and a mixed one costs a decode step its T rows each time
        (and pads otherwise: bfloat16's tokens would depend on which bucket was compiled).
        -> (bucket, whether it is only lent to the step)."""
        if kind == "spec_window":  # its buckets are a decode bucket's rows, k + 1 tokens each
            return self.buckets.window_shape(num_seqs, self.layout.num_speculative_tokens)[0], False
        exact = self.buckets.select(num_tokens, num_seqs)
        if self.is_ready(exact, kind):
            return exact, False
        decode_only = kind in ("window", "ahead") or (
            exact.is_decode and not self.executables.background
        )
        for bucket in self.buckets.fitting(num_tokens, num_seqs, decode_only=decode_only):
            if self.is_ready(bucket, kind):
                self.executables.compile_in_background([(exact, kind, SamplerPlan.DYNAMIC)])
                return bucket, True
        return exact, False

    def queue_decode_shapes(self, num_seqs: int) -> None:
        """Queue the compiles of the shapes that decode steps of `num_seqs` sequences will run
        in, so that they start beside the step before: a window's only where the scheduler
        runs one of `num_seqs` (all_shapes lists no other)."""
        bucket = self.buckets.select(num_seqs, num_seqs)
        shapes = [(bucket, "step")]
        k = self.layout.num_speculative_tokens
        if self.num_scheduler_steps > 1 and self.buckets.runs_window(num_seqs, k):
            shapes.append(self.buckets.window_shape(num_seqs, k))
        if self.async_scheduling:
            shapes.append((bucket, "ahead"))
        self.executables.compile_in_background(
            [(bucket, kind, SamplerPlan.DYNAMIC) for bucket, kind in shapes]
        )


def describe_shape(bucket: Bucket, kind: str, plan: SamplerPlan, num_steps: int) -> str:
    """A shape's name in log lines; every executable gets its own."""
    plan_name = "" if plan is SamplerPlan.DYNAMIC else f", {plan.value} sampling"
    if not bucket.is_decode and kind != "spec_window":
        return f"mixed bucket (tokens={bucket.num_tokens}, seqs={bucket.num_seqs}){plan_name}"
    what = f"decode bucket (seqs={bucket.num_seqs})"
    if kind == "spec_window":
        return f"{what}, {num_steps}-round speculative window{plan_name}"
    if kind == "window":
        return f"{what}, {num_steps}-step window{plan_name}"
    return f"{what}{', run ahead' if kind == 'ahead' else ''}{plan_name}"
