"""What the runners of speculative decoding's draft models share (worker/draft_runner.py, a
whole draft model; worker/eagle_runner.py, a draft head): a KV cache over the target's page ids,
and the proposals they hand the scheduler."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jvllm.config import ModelConfig
from jvllm.core.request import Request
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.sharded_model import KV_CACHE_SPEC
from jvllm.worker.buckets import BucketSpec
from jvllm.worker.kv_layout import allocate_kv_cache, kv_cache_shape, kv_cache_spec


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


def proposals_of(
    requests: list[Request], num_drafts: list[int], drafts: jax.Array
) -> dict[str, tuple[int, list[int]]]:
    """request id -> (its num_tokens now, its first num_drafts of row s of `drafts` i32[S, k])."""
    drafts = np.asarray(drafts)
    return {
        r.request_id: (r.num_tokens, drafts[s, :n].tolist())
        for s, (r, n) in enumerate(zip(requests, num_drafts))
    }
