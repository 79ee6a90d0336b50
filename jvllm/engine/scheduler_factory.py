"""The engine's scheduler, made from its config over a KV cache of the worker's size."""

from jvllm.core.engine_config import EngineConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.scheduler import Scheduler
from jvllm.core.spec_decode import DraftProposer


def make_scheduler(config: EngineConfig, num_blocks: int, can_cache_prefix: bool) -> Scheduler:
    """The scheduler over a KV cache of `num_blocks`; `can_cache_prefix`: whether the engine's
    requests may reuse prefix-cache blocks at all (a pooling runner's may not all)."""
    cache, spec = config.cache_config, config.speculative_config
    return Scheduler(
        config.scheduler_config,
        KVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching and can_cache_prefix,
            cache.prefix_caching_hash_algo,
            cache.kv_groups,
        ),
        spec and DraftProposer(spec, config.max_model_len),
    )
