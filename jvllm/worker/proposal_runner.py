"""What the runners of speculative decoding's draft models share (worker/draft_runner.py, a
whole draft model; worker/eagle_runner.py, a draft head): a KV cache over the target's page ids,
and the drafts the target's step proposed (`DraftProposals`), which they hand the scheduler; a
group of data-parallel ranks keeps one DraftProposals a rank (worker/rank_group.py)."""

import jax
import numpy as np
from jax.sharding import Mesh

from jvllm.config import ModelConfig
from jvllm.core.request import Request
from jvllm.distributed.sharded_model import KV_CACHE_SPEC
from jvllm.worker.draft_model import num_drafts_room
from jvllm.worker.kv_layout import new_kv_cache


class DraftProposals:
    """The drafts a draft model or head proposed in the last step, until the scheduler asks
    for those of the requests that decode next."""

    def __init__(self, block_size: int, num_speculative_tokens: int) -> None:
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        # The last step's drafts ([S, k], on the device or the host) and each of its requests'
        # row in them.
        self._drafts: jax.Array | np.ndarray | None = None
        self._rows: dict[str, int] = {}

    def keep_drafts(self, drafts, requests: list[Request]) -> None:
        """The drafts i32[S, k] the step just run over `requests` (its rows, in order) made."""
        self._drafts = drafts
        self._rows = {r.request_id: s for s, r in enumerate(requests)}

    def drop_drafts(self, request_ids) -> None:
        """Forget the last step's drafts of these requests (made for positions they did not
        reach)."""
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    def propose(
        self, requests: list[Request], block_ids: list[list[int]]
    ) -> dict[str, tuple[int, list[int]]]:
        """The drafts for `requests`, which will decode next and were in the last step:
        request id -> (its num_tokens now, up to num_speculative_tokens drafts), fewer where
        its blocks end before its position + k (the drafts past them were computed over the
        null page)."""
        known = [(r, b) for r, b in zip(requests, block_ids) if r.request_id in self._rows]
        k, block_size = self.num_speculative_tokens, self.block_size
        room = [num_drafts_room(r, b, k, block_size) for r, b in known]
        taking = [(r, n) for (r, _), n in zip(known, room) if n >= 1]
        if not taking:
            return {}
        drafts = np.asarray(self._drafts)[[self._rows[r.request_id] for r, _ in taking]]
        return {
            r.request_id: (r.num_tokens, drafts[i, :n].tolist()) for i, (r, n) in enumerate(taking)
        }


class ProposalRunner(DraftProposals):
    def __init__(
        self,
        config: ModelConfig,
        mesh: Mesh,
        *,
        num_blocks: int,
        block_size: int,
        attention_backend: str,
        kv_cache_dtype: str,
        num_speculative_tokens: int,
    ) -> None:
        """The draft's KV cache `kv_cache` over `num_blocks` pages (the target's page ids)."""
        super().__init__(block_size, num_speculative_tokens)
        self.kv_cache = new_kv_cache(
            config,
            mesh,
            KV_CACHE_SPEC,
            num_blocks=num_blocks,
            block_size=block_size,
            attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype,
        )
        # The step's options (step_fn.model_step) that run the draft: its model, or its head;
        # whether it reads the inputs of some of the target's layers (EAGLE-3). Set by each
        # kind of runner.
        self.step_options: dict = {}
        self.reads_layer_inputs = False
