"""Host-side engine core: requests, the KV block pool and cache manager, the scheduler (no JAX)."""

from jvllm.core.block_pool import BlockPool, KVCacheBlock
from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler import Scheduler
from jvllm.core.scheduler_output import SchedulerOutput

__all__ = [
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
