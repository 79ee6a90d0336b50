"""The model runner: owns the parameters, the paged KV array and every `jax.jit` of the engine."""

import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention.backends import get_attention
from jvllm.attention.reference import pages_per_chunk
from jvllm.config import ModelConfig
from jvllm.core.scheduler import SchedulerOutput
from jvllm.logger import init_logger
from jvllm.models.llama import compute_logits, forward
from jvllm.sample.sampler import sample
from jvllm.worker.buckets import Bucket, BucketSpec
from jvllm.worker.step_inputs import StepInputs, prepare_step_inputs

logger = init_logger(__name__)


def enable_compilation_cache() -> None:
    """Keep compiled buckets on disk so that a second start-up skips XLA (about 3 s a bucket on
    2 CPU cores for SmolLM2). `JVLLM_COMPILATION_CACHE_DIR=""` turns it off; a cache the user
    configured for JAX is left alone."""
    if jax.config.jax_compilation_cache_dir:
        return
    default = os.path.join(os.path.expanduser("~"), ".cache", "jvllm", "xla")
    path = os.environ.get("JVLLM_COMPILATION_CACHE_DIR", default)
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _step(params, kv_cache, inputs: StepInputs, *, config: ModelConfig, attn):
    """forward + sample for one padded step -> (i32[S] sampled token ids, kv_cache)."""
    hidden, kv_cache = forward(
        params, kv_cache, inputs.token_ids, inputs.positions, inputs.attn, config=config, attn=attn
    )
    logits = compute_logits(params, hidden[inputs.attn.logits_indices], config=config)  # [S, V]
    return sample(logits, inputs.sampling), kv_cache


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    # [L, 2, K, P, B, H]
    return (config.num_layers, 2, config.num_kv_heads, num_blocks, block_size, config.head_dim)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        buckets: BucketSpec,
        attention_backend: str,
    ):
        self.config = config
        self.params = params
        self.block_size = block_size
        self.buckets = buckets
        self.attention_backend = attention_backend
        chunk = pages_per_chunk(block_size)
        # Block tables are padded so the reference backend's page chunks tile them exactly.
        self.max_pages = math.ceil(math.ceil(max_model_len / block_size) / chunk) * chunk
        dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
        self.kv_cache = jnp.zeros(kv_cache_shape(config, num_blocks, block_size), dtype)
        enable_compilation_cache()
        attn = get_attention(attention_backend, sm_scale=config.head_dim**-0.5)
        self._step_fn = jax.jit(
            functools.partial(_step, config=config, attn=attn), donate_argnums=(1,)
        )
        self._executables: dict[Bucket, jax.stages.Compiled] = {}
        self.compile_seconds = 0.0

    @property
    def num_compilations(self) -> int:
        return len(self._executables)

    def _executable(self, bucket: Bucket) -> jax.stages.Compiled:
        exe = self._executables.get(bucket)
        if exe is None:
            start = time.perf_counter()
            dummy = prepare_step_inputs([], [], [], bucket, self.block_size, self.max_pages)
            exe = self._step_fn.lower(self.params, self.kv_cache, dummy).compile()
            self.compile_seconds += time.perf_counter() - start
            self._executables[bucket] = exe
            logger.debug("compiled %s in %.2fs", bucket, time.perf_counter() - start)
        return exe

    def compile_all(self, progress: bool = True) -> None:
        """Compile every bucket up front so that nothing compiles while serving."""
        buckets = self.buckets.all_buckets()
        start = time.perf_counter()
        for i, bucket in enumerate(buckets):
            if progress:
                logger.info(
                    "compiling bucket %d/%d (tokens=%d, seqs=%d)",
                    i + 1, len(buckets), bucket.num_tokens, bucket.num_seqs,
                )
            self._executable(bucket)
        logger.info(
            "compiled %d buckets in %.1fs", len(buckets), time.perf_counter() - start
        )

    def execute_model(self, scheduler_output: SchedulerOutput, block_ids: list[list[int]]) -> np.ndarray:
        """Run one scheduled step; returns the sampled token of every scheduled request, in order."""
        requests = scheduler_output.scheduled_requests
        counts = [scheduler_output.num_scheduled_tokens[r.request_id] for r in requests]
        bucket = self.buckets.select(sum(counts), len(requests))
        inputs = prepare_step_inputs(
            requests, counts, block_ids, bucket, self.block_size, self.max_pages
        )
        sampled, self.kv_cache = self._executable(bucket)(self.params, self.kv_cache, inputs)
        return np.asarray(sampled)[: len(requests)]
