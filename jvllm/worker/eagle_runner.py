"""An EAGLE-3 head on the runner's device (speculative decoding's "eagle3" method,
worker/eagle.py): its params, its KV cache over the target's pages, what the target's step
runs of it, and its jitted proposal step, one executable a decode bucket."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jvllm.attention.backends import get_attention
from jvllm.config import ModelConfig
from jvllm.core.request import Request
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.sharded_model import KV_CACHE_SPEC
from jvllm.distributed.tensor_parallel import param_specs, params_in_specs, shard_config
from jvllm.worker.buckets import Bucket
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.eagle import HeadState, draft_head, propose_eagle
from jvllm.worker.proposal_runner import ProposalRunner, proposals_of
from jvllm.worker.step_compiler import abstract_state
from jvllm.worker.step_inputs import StepInputs


class EagleRunner(ProposalRunner):
    def __init__(
        self, draft: DraftModel, target: ModelConfig, target_params, mesh: Mesh, **layout
    ) -> None:
        """The head's params and KV cache, `head` for the target's step, and its proposal
        step, which embeds with the target's `target_params`; `layout`: ProposalRunner's.
        Under tensor parallelism the head's layer is cut as the target's layers are (its
        heads and MLP over the "model" axis, its KV cache on its KV heads), inside a shard_map
        of its own; its fc and LM head run outside, as XLA partitions them."""
        config = draft.config
        super().__init__(config, mesh, **layout)
        self.params = draft.params
        attn = get_attention(layout["attention_backend"], sm_scale=config.sm_scale)
        self.head = draft_head(config, target, attn)
        num_shards = mesh.shape[TP_AXIS]
        if num_shards > 1:
            local = draft_head(shard_config(config, num_shards), target, attn)
            specs = params_in_specs(param_specs(config), self.params)
            whole = PartitionSpec()
            forward = jax.shard_map(
                local.forward,
                mesh=mesh,
                in_specs=(specs, KV_CACHE_SPEC, whole, whole, whole, whole),
                out_specs=(whole, whole, KV_CACHE_SPEC),
                check_vma=False,
            )
            self.head = dataclasses.replace(self.head, forward=forward)
        propose = functools.partial(
            propose_eagle,
            head=self.head,
            num_steps=self.num_speculative_tokens,
            block_size=self.block_size,
        )
        self._propose = jax.jit(propose, donate_argnums=1)
        self._state_spec = abstract_state(((target_params, self.params), self.kv_cache))
        # The last step's HeadState (on the device, max_num_seqs rows) and each of its
        # requests' row in it.
        num_rows = self.buckets.max_num_seqs
        pad = lambda a: jnp.pad(a, [(0, num_rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
        self._pad_state = jax.jit(lambda state: jax.tree.map(pad, state))
        self._state: HeadState | None = None
        self._rows: dict[str, int] = {}

    def keep_state(self, state: HeadState, requests: list[Request]) -> None:
        """What the step just run over `requests` (its rows, in order) left the proposal,
        padded to max_num_seqs rows so that one proposal executable a bucket reads any step's."""
        self._state = self._pad_state(state)
        self._rows = {r.request_id: s for s, r in enumerate(requests)}

    def _lower(self, bucket: Bucket, padding: StepInputs) -> jax.stages.Lowered:
        num_rows = self.buckets.max_num_seqs
        state = HeadState(
            jax.ShapeDtypeStruct((num_rows,), np.int32),
            jax.ShapeDtypeStruct((num_rows, self.config.hidden_size), np.float32),
        )
        rows = steps = np.zeros(bucket.num_seqs, np.int32)
        return self._propose.lower(*self._state_spec, padding, steps, state, rows)

    def propose(
        self, requests: list[Request], block_ids: list[list[int]], target_params, kv_cache
    ) -> tuple[dict[str, tuple[int, list[int]]], object]:
        """The head's drafts for `requests`, which will decode next and were in the last step:
        request id -> (its num_tokens now, up to num_speculative_tokens drafts), fewer where
        its blocks end before its position + k (as DraftRunner.propose's) -> (the drafts,
        the head's `kv_cache` it returns)."""
        known = [i for i, r in enumerate(requests) if r.request_id in self._rows]
        proposal = self._proposal([requests[i] for i in known], [block_ids[i] for i in known])
        if proposal is None:
            return {}, kv_cache
        requests, num_drafts, bucket, inputs, _ = proposal
        steps = np.zeros(bucket.num_seqs, np.int32)  # padding rows run no step
        steps[: len(requests)] = [n - 1 for n in num_drafts]
        rows = np.zeros(bucket.num_seqs, np.int32)
        rows[: len(requests)] = [self._rows[r.request_id] for r in requests]
        drafts, kv_cache = self.executable(bucket)(
            (target_params, self.params), kv_cache, inputs, steps, self._state, rows
        )
        return proposals_of(requests, num_drafts, drafts), kv_cache
