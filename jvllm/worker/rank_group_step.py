"""The executables of a group of data-parallel ranks whose MoE layers run across them
(worker/rank_group.py): the engine's step (a pooling runner's: its pooling step), with
num_scheduler_steps > 1 its decode window (with drafts, a window of speculative rounds:
worker/spec_window.py), with async scheduling the decode step run ahead (async_step.py), each
run by every device of the ("data", "model") mesh on its rank's inputs inside one shard_map,
one executable a (bucket, kind), compiled on first use or all up front.

With a draft model or head (speculative decoding) each device runs it inside the step as one
engine does (step_fn.model_step), on its rank's rows and draft KV pages: a draft model or an
MTP, EAGLE-1 or EAGLE-3 head cut over the rank's T devices as the target is (a head's
logits gathered over them); an MoE layer of either (an MTP layer's experts) reaches
across the ranks as the target's do, every rank running the same k draft steps.

A window's MoE layers exchange tokens with every rank at every step, so every rank steps as
long as any row of any rank still decodes (decode_loop.run_window's `any_active`, a psum over
"data"): a rank whose rows have stopped steps them over its null page.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.attention.backends import get_attention
from jvllm.config import ModelConfig
from jvllm.core.engine_config import RunnerConfig
from jvllm.distributed.data_parallel_moe import KV_CACHE_SPEC, RANKS_SPEC, rank_config
from jvllm.distributed.mesh import DP_AXIS, TP_AXIS
from jvllm.distributed.sharded_model import ShardedModel
from jvllm.distributed.tensor_parallel import param_specs, params_in_specs
from jvllm.models.model import compute_logits, forward, forward_counting_experts, num_moe_layers
from jvllm.spec_decode.config import HEAD_METHODS
from jvllm.worker.buckets import Bucket, BucketSpec
from jvllm.worker.decode_loop import prepare_window_inputs, window_steps_per_check
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.eagle import draft_head
from jvllm.worker.pooler import pool_step, prepare_pool_inputs
from jvllm.worker.rank_adapters import slots_over_ranks
from jvllm.worker.step_compiler import StepLayout
from jvllm.worker.step_fn import model_step
from jvllm.worker.step_kinds import StepKinds


def _rank_model(config: ModelConfig, attn, vocab_size: int) -> ShardedModel:
    """The model as one device of a rank runs it inside the group's shard_map: its rank's
    tensor-parallel shard `config`, logits gathered whole (`vocab_size`) over its T devices."""

    def logits(params, hidden):
        local = compute_logits(params, hidden, config=config)  # [S, V/T]
        whole = jax.lax.all_gather(local, TP_AXIS, axis=1, tiled=True)  # [S, padded V]
        return whole[:, :vocab_size]

    return ShardedModel(
        functools.partial(forward, config=config, attn=attn),
        logits,
        functools.partial(forward_counting_experts, config=config, attn=attn),
    )


def _draft_options(
    draft: DraftModel | None, target: ModelConfig, mesh: Mesh, runner_config: RunnerConfig
) -> dict:
    """model_step's options that run `draft` on one device of a rank (none without one)."""
    if draft is None:
        return {}
    config, backend = draft.config, runner_config.attention_backend
    local = rank_config(config, mesh)
    if draft.method in HEAD_METHODS:
        attn = get_attention(backend, sm_scale=config.sm_scale)
        k, vocab = runner_config.num_speculative_tokens, target.vocab_size
        return {"draft_head": draft_head(local, rank_config(target, mesh), attn, k, vocab)}
    attn = get_attention(backend, sm_scale=config.sm_scale, logit_softcap=config.attn_logit_softcap)
    return {"draft_model": _rank_model(local, attn, config.vocab_size)}


def _any_rank_active(active: jax.Array) -> jax.Array:
    """bool[S] a rank's rows still decoding -> whether any row of any rank is."""
    return jax.lax.psum(jnp.any(active).astype(jnp.int32), DP_AXIS) > 0


class GroupExecutables:
    def __init__(
        self,
        config: ModelConfig,
        params,
        mesh: Mesh,
        attn,
        runner_config: RunnerConfig,
        layout: StepLayout,
        state_spec,
        draft: DraftModel | None = None,
    ):
        """The group's kinds of executable for `config` and its `params` on `mesh`, every
        step laid out in `layout`; `state_spec`: (params, kv_cache, token_cache, bias rows) as
        ShapeDtypeStructs, what each executable is lowered for. With a speculative `draft`
        (its params on `mesh`) the params and KV caches are (target's, draft's) pairs."""
        self.mesh, self.layout, self.state_spec = mesh, layout, state_spec
        self.num_ranks = mesh.shape[DP_AXIS]
        model = _rank_model(rank_config(config, mesh), attn, config.vocab_size)
        specs = params_in_specs(param_specs(config), params)
        if config.max_loras:  # each rank's adapter slots on its own row
            specs = slots_over_ranks(specs, config)
        self._executables: dict[tuple[Bucket, str], jax.stages.Compiled] = {}
        # A decode window's kind: with drafts, a window of speculative rounds.
        self.num_drafts = num_drafts = runner_config.num_speculative_tokens
        self.window_kind = "spec_window" if num_drafts else "window"
        # A pooling runner's ranks pool their prompts' chunks (worker/pooler.py), never sample.
        self.pooling_type = runner_config.pooling_type
        if self.pooling_type is not None:
            self.kinds = ("pool",)
            self._jitted = {"pool": self._jit_pool(model.forward, specs)}
            return
        step = functools.partial(
            model_step,
            model=model,
            max_logprobs=runner_config.max_logprobs,
            logprobs_mode=runner_config.logprobs_mode,
            num_drafts=layout.num_speculative_tokens,
            **_draft_options(draft, config, mesh, runner_config),
        )
        counts_shape = (num_moe_layers(config), config.num_experts)
        kinds = StepKinds(runner_config, window_steps_per_check(), counts_shape)
        is_windowed = runner_config.num_scheduler_steps > 1
        self.kinds = ("step", self.window_kind) if is_windowed else ("step",)
        if runner_config.async_scheduling:  # the decode step dispatched ahead of its schedule
            self.kinds += ("ahead",)
        kv_spec = KV_CACHE_SPEC
        if draft is not None:
            specs = (specs, params_in_specs(param_specs(draft.config), draft.params))
            kv_spec = (KV_CACHE_SPEC, KV_CACHE_SPEC)
        self._jitted = {
            kind: self._jit(kind, kinds.body(kind, step), specs, kv_spec) for kind in self.kinds
        }

    def _jit(self, kind: str, body, param_specs_, kv_spec):
        """jit of `body` (StepKinds' body of `kind`) on every device: (params, kv_cache,
        token_cache, bias_rows [D R, V], inputs [D, ...], and a window's WindowInputs [D, ...],
        or the step run ahead's sampled tokens i32[D, S] and active rows bool[D, S]) -> (its
        output with a leading [D] (the step run ahead's: with its inputs), kv_cache,
        token_cache), the caches donated."""
        extra = {"any_active": _any_rank_active} if kind in ("window", "spec_window") else {}

        def on_rank(params, kv_cache, token_cache, bias_rows, *inputs):
            local = [jax.tree.map(lambda a: a[0], x) for x in inputs]
            if kind == "ahead":  # (SamplerOutput, its StepInputs), kv_cache, token_cache
                out, next_inputs, kv_cache, token_cache = body(
                    params, kv_cache, token_cache, bias_rows, *local
                )
                out = (out, next_inputs)
            else:
                out, kv_cache, token_cache = body(
                    params, kv_cache, token_cache, bias_rows, *local, **extra
                )
            return jax.tree.map(lambda a: a[None], out), kv_cache, token_cache

        def mapped(params, kv_cache, token_cache, bias_rows, *inputs):
            in_specs = (param_specs_, kv_spec, RANKS_SPEC, RANKS_SPEC)
            return jax.shard_map(
                on_rank,
                mesh=self.mesh,
                in_specs=(*in_specs, *[RANKS_SPEC] * len(inputs)),
                out_specs=(RANKS_SPEC, kv_spec, RANKS_SPEC),
                check_vma=False,
            )(params, kv_cache, token_cache, bias_rows, *inputs)

        return jax.jit(mapped, donate_argnums=(1, 2))

    def _jit_pool(self, model_forward, param_specs_):
        """jit of the pooling step on every device: (params, kv_cache, PoolInputs [D, ...])
        -> (pooled f32[D, S, H], kv_cache), the cache donated."""

        def on_rank(params, kv_cache, inputs):
            local = jax.tree.map(lambda a: a[0], inputs)
            pooled, kv_cache = pool_step(params, kv_cache, local, forward=model_forward)
            return pooled[None], kv_cache

        def mapped(params, kv_cache, inputs):
            return jax.shard_map(
                on_rank,
                mesh=self.mesh,
                in_specs=(param_specs_, KV_CACHE_SPEC, RANKS_SPEC),
                out_specs=(RANKS_SPEC, KV_CACHE_SPEC),
                check_vma=False,
            )(params, kv_cache, inputs)

        return jax.jit(mapped, donate_argnums=1)

    def __len__(self) -> int:
        return len(self._executables)

    def __call__(self, bucket: Bucket, kind: str) -> jax.stages.Compiled:
        """The `kind` executable of `bucket`, compiled on its first use (the same on every
        process: each compiles what the exchanged sizes select)."""
        exe = self._executables.get((bucket, kind))
        if exe is None:
            exe = self._jitted[kind].lower(*self._abstract_args(bucket, kind)).compile()
            self._executables[bucket, kind] = exe
        return exe

    def compile_all(self, buckets: BucketSpec) -> None:
        """Every bucket's step (with async scheduling, every decode bucket's step run ahead
        too), and where windows run every window shape that the ranks' schedulers can run."""
        for bucket in buckets.all_buckets():
            self(bucket, self.kinds[0])
            if bucket.is_decode and "ahead" in self.kinds:
                self(bucket, "ahead")
        if self.window_kind in self.kinds:
            for bucket, kind in buckets.window_shapes(self.num_drafts):
                self(bucket, kind)

    def _abstract_args(self, bucket: Bucket, kind: str):
        """An executable's arguments as ShapeDtypeStructs: the arrays' own, and every rank's
        step (and window) of `bucket` [D, ...] cut over "data"."""
        ranks = NamedSharding(self.mesh, RANKS_SPEC)
        padding = [self.padding(bucket, kind)]
        if kind == "ahead":  # the step before's sampled tokens, and which rows go on
            num_seqs = bucket.num_seqs
            padding += [np.zeros(num_seqs, np.int32), np.zeros(num_seqs, bool)]
        elif kind not in ("step", "pool"):
            padding.append(prepare_window_inputs([], [], bucket.num_seqs))
        stacked = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                (self.num_ranks, *np.shape(a)), np.asarray(a).dtype, sharding=ranks
            ),
            padding,
        )
        params, kv_cache, token_cache, bias_rows = self.state_spec
        if kind == "pool":
            return (params, kv_cache, *stacked)
        return (params, kv_cache, token_cache, bias_rows, *stacked)

    def padding(self, bucket: Bucket, kind: str):
        """A rank's step of nothing in `bucket` (its rows write only the null page)."""
        adapter_slots = np.zeros(0, np.int32) if self.layout.has_adapters else None
        step = self.layout.inputs([], [], [], bucket, adapter_slots=adapter_slots)
        return step if kind != "pool" else prepare_pool_inputs(step, [], [], self.pooling_type)
