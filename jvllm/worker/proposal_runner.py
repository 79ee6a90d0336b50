"""What the runners of speculative decoding's draft models share (worker/draft_runner.py, a
whole draft model; worker/eagle_runner.py, an EAGLE-3 head): a KV cache over the target's page
ids, and a proposal step compiled once a decode bucket."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.config import ModelConfig
from jvllm.core.request import Request
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.sharded_model import KV_CACHE_SPEC
from jvllm.worker.buckets import Bucket, BucketSpec
from jvllm.worker.draft_model import prepare_proposal
from jvllm.worker.kv_layout import allocate_kv_cache, kv_cache_shape, kv_cache_spec
from jvllm.worker.step_inputs import StepInputs, prepare_step_inputs


class ProposalRunner:
    def __init__(
        self,
        config: ModelConfig,
        mesh: Mesh,
        *,
        num_blocks: int,
        block_size: int,
        max_pages: int,
        buckets: BucketSpec,
        attention_backend: str,
        kv_cache_dtype: str,
        num_speculative_tokens: int,
    ) -> None:
        """The draft's KV cache `kv_cache` over `num_blocks` pages (the target's page ids)."""
        self.config = config
        self.block_size, self.max_pages, self.buckets = block_size, max_pages, buckets
        self.num_speculative_tokens = num_speculative_tokens
        self.kv_cache = allocate_kv_cache(
            kv_cache_spec(config.dtype, attention_backend, kv_cache_dtype),
            kv_cache_shape(config, num_blocks, block_size, mesh.shape[TP_AXIS]),
            NamedSharding(mesh, KV_CACHE_SPEC),
        )
        self._executables: dict[Bucket, jax.stages.Compiled] = {}

    def executable(self, bucket: Bucket) -> jax.stages.Compiled:
        """The proposal step of a decode bucket, compiled on first use (or by compile_all)."""
        exe = self._executables.get(bucket)
        if exe is None:
            layout = (bucket, self.block_size, self.max_pages, self.config.vocab_size)
            exe = self._lower(bucket, prepare_step_inputs([], [], [], *layout)).compile()
            self._executables[bucket] = exe
        return exe

    def _lower(self, bucket: Bucket, padding: StepInputs) -> jax.stages.Lowered:
        """The proposal step lowered for `bucket`, whose inputs are laid out as `padding`."""
        raise NotImplementedError

    def _proposal(self, requests: list[Request], block_ids: list[list[int]]):
        """draft_model.prepare_proposal for these requests, with this runner's layout."""
        return prepare_proposal(
            requests,
            block_ids,
            self.num_speculative_tokens,
            self.buckets,
            self.block_size,
            self.max_pages,
            self.config.vocab_size,
        )


def proposals_of(
    requests: list[Request], num_drafts: list[int], drafts: jax.Array
) -> dict[str, tuple[int, list[int]]]:
    """request id -> (its num_tokens now, its first num_drafts of row s of `drafts` i32[S, k])."""
    drafts = np.asarray(drafts)
    return {
        r.request_id: (r.num_tokens, drafts[s, :n].tolist())
        for s, (r, n) in enumerate(zip(requests, num_drafts))
    }
