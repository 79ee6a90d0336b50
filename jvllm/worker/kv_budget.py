"""How many KV blocks the engine gets, as vLLM sizes its cache: `num_gpu_blocks_override`, else
the bytes of `kv_cache_memory_bytes`, else what the device (or, on CPU, the host) has free once
the weights are loaded, less a reserve for the step's activations.

Pure functions over probed numbers (device memory stats, /proc/meminfo's text), so that tests
can feed them fakes; `probe_memory` is the one place that reads the machine."""

import dataclasses
import pathlib
from collections.abc import Mapping

import jax

from jvllm.config import ModelConfig
from jvllm.core.decode_window import window_capacity
from jvllm.core.engine_config import CacheConfig, RunnerConfig
from jvllm.core.kv_groups import KVCacheGroups, blocks_to_hold
from jvllm.distributed.tensor_parallel import shard_config
from jvllm.sample.logprobs import PROMPT_LOGPROBS_CHUNK
from jvllm.worker.buckets import BucketSpec
from jvllm.worker.kv_layout import KVCacheSpec

# The CPU default: at most this much KV, from at most this fraction of the host's free memory.
# A few cores gain nothing from a larger pool (their step time, not the pool, bounds the batch),
# and tests and benchmarks keep several engines in one process.
CPU_KV_CACHE_CAP_BYTES = 1 << 30
CPU_FREE_MEMORY_FRACTION = 0.5
_FLOAT32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class MemoryProbe:
    """What the machine reports after the weights are loaded."""

    backend: str  # jax.default_backend()
    device_stats: Mapping[str, int] | None  # device.memory_stats(); None on CPU
    meminfo: str  # /proc/meminfo's text; "" off CPU or where there is none


def probe_memory() -> MemoryProbe:
    backend = jax.default_backend()
    if backend != "cpu":
        return MemoryProbe(backend, jax.devices()[0].memory_stats(), "")
    try:
        meminfo = pathlib.Path("/proc/meminfo").read_text()
    except OSError:
        meminfo = ""
    return MemoryProbe(backend, None, meminfo)


@dataclasses.dataclass(frozen=True)
class KVBudget:
    num_bytes: int
    source: str  # where the number came from, for the start-up log
    remedy: str  # what raises it, for the too-small error


@dataclasses.dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int  # null block included
    num_bytes: int  # one device's, under tensor parallelism
    source: str
    kv_dtype: str  # what a value is stored as (KVCacheSpec.name)

    def describe(self, block_size: int, per_device: bool) -> str:
        """For the start-up log."""
        return (
            f"{self.kv_dtype} at {self.num_bytes // (self.num_blocks * block_size)} bytes a "
            f"token, {self.num_blocks} blocks of {block_size} tokens = "
            f"{(self.num_blocks - 1) * block_size} tokens besides the null block "
            f"({self.num_bytes / 2**20:.0f} MiB{' per device' if per_device else ''}, "
            f"from {self.source})"
        )


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, spec: KVCacheSpec, num_slots: int | None = None
) -> int:
    """K and V (or MLA's one latent row) of every layer (or of the `num_slots` layers a page
    of hybrid KV groups holds, core/kv_groups.py) for `block_size` tokens, a quantized cache's
    scales included.
    (The runner's token cache adds 4 bytes a token beside them, under 0.1% of this for real
    models: it is left to the headroom.)"""
    head_bytes = spec.head_bytes(config.head_dim)
    num_layers = config.num_layers if num_slots is None else num_slots
    num_rows = num_layers * config.kv_planes * config.num_kv_heads
    return num_rows * block_size * head_bytes


def size_kv_cache(
    cache: CacheConfig,
    limits: RunnerConfig,
    config: ModelConfig,
    spec: KVCacheSpec,
    max_model_len: int,
    probe: MemoryProbe,
    num_shards: int = 1,
    draft_config: ModelConfig | None = None,
) -> KVCacheSize:
    """The pool's block count (null block included) for a cache stored as `spec` says, and
    where it came from. With `num_shards` tensor-parallel devices the bytes are one device's
    (its 1/T of the KV heads); a CPU's host memory is shared by its devices, so each gets 1/T
    of the host's budget. `limits`: the step's (max_num_batched_tokens, max_num_seqs).

    A `draft_config` (speculative decoding's draft model) keeps its KV in pages of the same
    ids (worker/draft_model.py): a block's bytes are both models'.

    Raises ValueError when the budget holds less than one request of max_model_len tokens (an
    exact `num_gpu_blocks_override` is taken as given: tests use tiny pools on purpose)."""
    block_size, groups = cache.block_size, cache.kv_groups
    num_slots = groups.num_slots if groups else None
    bytes_per_block = kv_bytes_per_block(
        shard_config(config, num_shards), block_size, spec, num_slots
    )
    if draft_config is not None:
        bytes_per_block += kv_bytes_per_block(
            shard_config(draft_config, num_shards), block_size, spec
        )
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
        return KVCacheSize(
            num_blocks,
            num_blocks * bytes_per_block,
            f"num_gpu_blocks_override={num_blocks}",
            spec.name,
        )
    pages_per_request = blocks_to_hold(
        groups, max_model_len, block_size, limits.max_num_batched_tokens
    )
    needed = (pages_per_request + 1) * bytes_per_block  # one full request and the null block
    reserve = activation_reserve_bytes(config, *largest_step(limits))
    budget = _budget(cache, probe, reserve, needed * num_shards)
    if probe.backend == "cpu" and cache.kv_cache_memory_bytes is None and num_shards > 1:
        budget = dataclasses.replace(
            budget,
            num_bytes=budget.num_bytes // num_shards,
            source=f"{budget.source}; 1/{num_shards} each for the devices sharing the host",
        )
    if budget.num_bytes < needed:
        largest = _largest_max_model_len(
            budget.num_bytes // bytes_per_block - 1,
            groups,
            block_size,
            limits.max_num_batched_tokens,
            max_model_len,
        )
        raise ValueError(
            _too_small_message(budget, needed, bytes_per_block, block_size, max_model_len, largest)
        )
    source = budget.source
    num_blocks = budget.num_bytes // bytes_per_block
    # More than every sequence at full length could ever use is wasted memory.
    useful = limits.max_num_seqs * pages_per_request + 1
    if num_blocks > useful:
        num_blocks = useful
        source += (
            f"; capped at max_num_seqs={limits.max_num_seqs} requests of "
            f"max_model_len={max_model_len}"
        )
    return KVCacheSize(num_blocks, num_blocks * bytes_per_block, source, spec.name)


def _budget(
    cache: CacheConfig, probe: MemoryProbe, reserve_bytes: int, needed_bytes: int
) -> KVBudget:
    """The KV cache's bytes: the option when given, else the device's or the host's share."""
    if cache.kv_cache_memory_bytes is not None:
        return KVBudget(
            cache.kv_cache_memory_bytes,
            f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}",
            "increasing kv_cache_memory_bytes",
        )
    if probe.backend == "cpu":
        return host_budget(probe.meminfo, reserve_bytes, needed_bytes)
    return device_budget(probe.device_stats, cache.gpu_memory_utilization, reserve_bytes)


def device_budget(
    stats: Mapping[str, int] | None, utilization: float, reserve_bytes: int
) -> KVBudget:
    """`utilization` of what XLA's allocator may hand out, less what is in use (the weights)
    and the activation reserve (vLLM's gpu_memory_utilization).

    `bytes_limit` is the allocator's pool, XLA_PYTHON_CLIENT_MEM_FRACTION of the device (JAX
    takes 0.75 unless told), not the whole device: a budget beyond it could not be allocated."""
    if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
        raise ValueError(
            "the device reports no memory stats (bytes_limit, bytes_in_use; got "
            f"{stats!r}), so the KV cache cannot be sized from "
            "gpu_memory_utilization; pass kv_cache_memory_bytes or num_gpu_blocks_override"
        )
    limit, in_use = stats["bytes_limit"], stats["bytes_in_use"]
    free = int(utilization * limit) - in_use - reserve_bytes
    return KVBudget(
        max(free, 0),
        f"gpu_memory_utilization={utilization} of {_human_bytes(limit)}, less {_human_bytes(in_use)} in use "
        f"and {_human_bytes(reserve_bytes)} for activations",
        "increasing gpu_memory_utilization (or XLA_PYTHON_CLIENT_MEM_FRACTION)",
    )


def host_budget(
    meminfo: str,
    reserve_bytes: int,
    needed_bytes: int,
    cap_bytes: int = CPU_KV_CACHE_CAP_BYTES,
) -> KVBudget:
    """On CPU: a share of the free memory (MemAvailable, read after the weights are loaded, so
    they are already out of it) less the activation reserve, at most `cap_bytes`; raised to one
    max_model_len request (`needed_bytes`) where the free memory holds that."""
    available = meminfo_available_bytes(meminfo)
    free = available - reserve_bytes
    num_bytes = min(cap_bytes, int(CPU_FREE_MEMORY_FRACTION * free))
    how = f"min({_human_bytes(cap_bytes)}, {CPU_FREE_MEMORY_FRACTION} of what is left)"
    if num_bytes < needed_bytes:
        num_bytes = min(needed_bytes, free)
        how = "raised to one request of max_model_len" if num_bytes == needed_bytes else "all of it"
    return KVBudget(
        max(num_bytes, 0),
        f"CPU free memory: {_human_bytes(available)} available, less {_human_bytes(reserve_bytes)} for "
        f"activations; {how}",
        "freeing host memory",
    )


def meminfo_available_bytes(meminfo: str) -> int:
    """MemAvailable of /proc/meminfo's text, in bytes."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, unit = value.split()
            if unit != "kB":
                raise ValueError(f"/proc/meminfo's MemAvailable is in {unit!r}, not kB")
            return int(number) * 1024
    raise ValueError(
        "cannot read MemAvailable from /proc/meminfo to size the KV cache; pass "
        "kv_cache_memory_bytes or num_gpu_blocks_override"
    )


def largest_step(limits: RunnerConfig) -> tuple[int, int, int]:
    """(tokens, sequences, sampled rows) of the largest step the runner compiles:
    max_num_batched_tokens and max_num_seqs, and with k drafts a request the scored positions
    besides each sequence's row (worker/draft_scoring.py: at most min(T, S k) more), over a
    window of speculative rounds' bucket too: S (k + 1) tokens, S the decode bucket of the
    most requests whose rounds fit max_num_batched_tokens (worker/step_compiler.py), up to
    about twice max_num_batched_tokens."""
    num_tokens, num_seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    k = limits.num_speculative_tokens
    if k and limits.num_scheduler_steps > 1:
        most = max(1, min(num_seqs, window_capacity(num_tokens, k)))
        window = BucketSpec(num_tokens, num_seqs).select(most, most).num_seqs
        num_tokens = max(num_tokens, window * (k + 1))
    return num_tokens, num_seqs, num_seqs + min(num_tokens, num_seqs * k)


def activation_reserve_bytes(
    config: ModelConfig,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_sampled_rows: int | None = None,
) -> int:
    """Device memory a step needs beside the weights and the caches: a conservative bound on
    the compiled step's temporaries (XLA's `memory_analysis()` temp size) plus the bias rows
    the runner allocates after the KV cache. Every value counts as float32, and the phases are
    summed though they are live one after another:
    - the sampler: 8 [S, V] arrays (logits, filtered and sorted copies, probabilities), S
      `num_sampled_rows` (max_num_seqs, and with drafts their scored positions too);
    - prompt logprobs: 4 [C, V] arrays, C = the positions of one chunk;
    - one decoder layer over T tokens (the layer scan keeps one live): [T, 3F + 4D + (N + 2K)H]
      (MLA's latent path: 8NH in place of (N + 2K)H: its absorbed queries, the window's and
      the pages' weighted values and their merge are [T, N, C + R] each; DeepSeek-V3's
      attention at T = 1024 took 2526 MiB of temporaries),
      where a mixture of experts has k (token, expert) rows a token of 3F + 2D each and [T, E]
      router scores in place of the MLP's 3F (and a shared expert's 3F beside them);
    - the bias rows: [S + 1, V].
    A formula, not a measurement, so that start-up compiles nothing to size the cache;
    tests/test_kv_budget.py checks that it bounds the compiled buckets' temp size, and
    BENCHMARKS.md ("KV cache sizing") has the figures."""
    c = config
    num_tokens, num_seqs = max_num_batched_tokens, max_num_seqs
    chunk = min(num_tokens, PROMPT_LOGPROBS_CHUNK)
    sampled = num_seqs if num_sampled_rows is None else num_sampled_rows
    sampler = 8 * sampled * c.vocab_size
    prompt_logprobs = 4 * chunk * c.vocab_size
    mlp = 3 * c.intermediate_size
    if c.num_experts:
        expert_width = c.moe_intermediate_size or c.intermediate_size
        mlp = c.num_experts_per_tok * (3 * expert_width + 2 * c.hidden_size) + c.num_experts
        mlp += 3 * c.shared_expert_intermediate_size
    attention = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    if c.kv_planes == 1:  # MLA's latent path: [T, N, C + R] queries, outputs, softmax parts
        attention = 8 * c.num_heads * c.head_dim
    layer = num_tokens * (mlp + 4 * c.hidden_size + attention)
    bias_rows = (num_seqs + 1) * c.vocab_size
    return _FLOAT32_BYTES * (sampler + prompt_logprobs + layer + bias_rows)


def _largest_max_model_len(
    num_blocks: int,
    groups: KVCacheGroups | None,
    block_size: int,
    max_step_tokens: int,
    max_model_len: int,
) -> int:
    """The longest max_model_len below `max_model_len` whose one request holds at most
    `num_blocks` in all its KV groups (kv_groups.blocks_to_hold, which grows with it)."""
    shortest, longest = 0, max_model_len
    while shortest < longest:
        length = (shortest + longest + 1) // 2
        if blocks_to_hold(groups, length, block_size, max_step_tokens) <= num_blocks:
            shortest = length
        else:
            longest = length - 1
    return shortest


def _too_small_message(
    budget: KVBudget,
    needed: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    largest: int,
) -> str:
    """vLLM's wording: what one request needs, what there is, and what to change (`largest`:
    the longest max_model_len the budget holds, 0 for none)."""
    message = (
        f"To serve at least one request of max_model_len={max_model_len} tokens, the KV cache "
        f"needs {_human_bytes(needed, 2)} ({needed // bytes_per_block} blocks of {block_size} tokens, "
        f"the null block included), more than the {_human_bytes(budget.num_bytes, 2)} available "
        f"({budget.source})."
    )
    if largest > 0:
        message += f" Based on the available memory, the largest max_model_len is {largest}."
    return message + f" Try {budget.remedy} or decreasing max_model_len."


def _human_bytes(num_bytes: int, digits: int = 1) -> str:
    if abs(num_bytes) < 2**30:
        return f"{num_bytes / 2**20:.{digits}f} MiB"
    return f"{num_bytes / 2**30:.{digits}f} GiB"
