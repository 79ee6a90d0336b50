"""A draft head on the runner's device (speculative decoding's "eagle3" and "mtp" methods,
worker/eagle.py): its params, its KV cache over the target's pages, what the target's step runs
of it, and the drafts the last step left for each of its requests."""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jvllm.attention.backends import get_attention
from jvllm.config import ModelConfig
from jvllm.core.request import Request
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.sharded_model import KV_CACHE_SPEC
from jvllm.distributed.tensor_parallel import param_specs, params_in_specs, shard_config
from jvllm.worker.draft_model import DraftModel, num_drafts_room
from jvllm.worker.eagle import draft_head
from jvllm.worker.proposal_runner import ProposalRunner, proposals_of


class EagleRunner(ProposalRunner):
    def __init__(self, draft: DraftModel, target: ModelConfig, mesh: Mesh, **layout) -> None:
        """The head's params and KV cache, and `head` for the target's step, which runs it
        over the step and k - 1 steps past it; `layout`: ProposalRunner's.
        Under tensor parallelism the head's layer is cut as the target's layers are (its
        heads and MLP over the "model" axis, its KV cache on its KV heads), inside a shard_map
        of its own; its fc and LM head run outside, as XLA partitions them."""
        config = draft.config
        super().__init__(config, mesh, **layout)
        self.params = draft.params
        attn = get_attention(layout["attention_backend"], sm_scale=config.sm_scale)
        k = self.num_speculative_tokens
        self.head = draft_head(config, target, attn, k)
        num_shards = mesh.shape[TP_AXIS]
        if num_shards > 1:
            local = draft_head(shard_config(config, num_shards), target, attn, k)
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
        # The last step's drafts (on the device, [S, k]) and each of its requests' row in them.
        self._drafts: jax.Array | None = None
        self._rows: dict[str, int] = {}

    def keep_drafts(self, drafts: jax.Array, requests: list[Request]) -> None:
        """The drafts i32[S, k] the step just run over `requests` (its rows, in order) made."""
        self._drafts = drafts
        self._rows = {r.request_id: s for s, r in enumerate(requests)}

    def propose(
        self, requests: list[Request], block_ids: list[list[int]]
    ) -> dict[str, tuple[int, list[int]]]:
        """The head's drafts for `requests`, which will decode next and were in the last step:
        request id -> (its num_tokens now, up to num_speculative_tokens drafts), fewer where
        its blocks end before its position + k (the drafts past them were computed over the
        null page)."""
        known = [(r, b) for r, b in zip(requests, block_ids) if r.request_id in self._rows]
        k, block_size = self.num_speculative_tokens, self.block_size
        room = [num_drafts_room(r, b, k, block_size) for r, b in known]
        taking = [(r, n) for (r, _), n in zip(known, room) if n >= 1]
        if not taking:
            return {}
        rows = [self._rows[r.request_id] for r, _ in taking]
        drafts = np.asarray(self._drafts)[rows]  # [R, k], the requests' rows in order
        return proposals_of([r for r, _ in taking], [n for _, n in taking], drafts)
