"""The draft model on the runner's mesh (speculative decoding's "draft_model" method,
worker/draft_model.py): its params, its KV cache over the target's pages, its model for the
target's step, and its jitted proposal step, one executable a decode bucket."""

import functools

import jax
import numpy as np
from jax.sharding import Mesh

from jvllm.attention.backends import get_attention
from jvllm.core.request import Request
from jvllm.distributed.sharded_model import sharded_model
from jvllm.layers.scan import unstack_layers
from jvllm.models.model import param_axes
from jvllm.worker.buckets import Bucket
from jvllm.worker.draft_model import DraftModel, prepare_proposal, propose_greedy
from jvllm.worker.proposal_runner import ProposalRunner, proposals_of
from jvllm.worker.step_compiler import abstract_state
from jvllm.worker.step_inputs import prepare_step_inputs


class DraftRunner(ProposalRunner):
    def __init__(self, draft: DraftModel, mesh: Mesh, *, layers_unstacked: bool, **layout) -> None:
        """The draft's params (layers split as the target's), its KV cache, its model and its
        proposal step; `layout`: ProposalRunner's."""
        config = draft.config
        super().__init__(config, mesh, **layout)
        params = (
            unstack_layers(draft.params, param_axes(config)) if layers_unstacked else draft.params
        )
        self.params = params
        attn = get_attention(
            layout["attention_backend"],
            sm_scale=config.sm_scale,
            logit_softcap=config.attn_logit_softcap,
        )
        self.model = sharded_model(config, mesh, attn, layers_unstacked, params)
        propose = functools.partial(
            propose_greedy,
            model=self.model,
            num_steps=self.num_speculative_tokens,
            block_size=self.block_size,
        )
        self._propose = jax.jit(propose, donate_argnums=1)
        self._state_spec = abstract_state((params, self.kv_cache))
        self._executables: dict[Bucket, jax.stages.Compiled] = {}

    def executable(self, bucket: Bucket) -> jax.stages.Compiled:
        """The proposal step of a decode bucket, compiled on first use (or by compile_all)."""
        exe = self._executables.get(bucket)
        if exe is None:
            layout = (bucket, self.block_size, self.max_pages, self.config.vocab_size)
            padding = prepare_step_inputs([], [], [], *layout)
            steps = np.ones(bucket.num_seqs, np.int32)
            exe = self._propose.lower(*self._state_spec, padding, steps).compile()
            self._executables[bucket] = exe
        return exe

    def propose(
        self, requests: list[Request], block_ids: list[list[int]], kv_cache
    ) -> tuple[dict[str, tuple[int, list[int]]], object]:
        """The draft model's greedy drafts for `requests`, which will decode next (each has
        computed all but its last token, the one just sampled, at position p): request id ->
        (its num_tokens now, up to num_speculative_tokens drafts), fewer where its blocks end
        before p + k (no lookahead slots); one jitted call for all of them over the draft's
        `kv_cache` -> (the drafts, the cache it returns)."""
        proposal = prepare_proposal(
            requests,
            block_ids,
            self.num_speculative_tokens,
            self.buckets,
            self.block_size,
            self.max_pages,
            self.config.vocab_size,
        )
        if proposal is None:
            return {}, kv_cache
        requests, num_steps, bucket, inputs, steps_per_row = proposal
        drafts, kv_cache = self.executable(bucket)(self.params, kv_cache, inputs, steps_per_row)
        return proposals_of(requests, num_steps, drafts), kv_cache
