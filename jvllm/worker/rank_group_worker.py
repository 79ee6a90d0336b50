"""The Worker of a group of data-parallel ranks whose MoE layers run across them
(worker/rank_group.py): it loads the model once onto the D x T mesh (the routed experts placed
over every device, the rest replicated over the ranks), sizes each rank's KV pool, and makes
the group's runner; each rank's LLMEngine gets a `RankWorker`, the view of the group that the
engine reaches the device through, as it would its own Worker."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable

import jax

from jvllm.attention.backends import default_backend, prepare_backend
from jvllm.core.engine_config import EngineConfig
from jvllm.cpu_malloc import keep_freed_memory
from jvllm.distributed.data_parallel_moe import choose_all2all_backend
from jvllm.distributed.mesh import describe_placement, rank_group_mesh
from jvllm.logger import init_logger
from jvllm.lora.config import adapter_config
from jvllm.model_loader.generation_config import load_generation_config
from jvllm.model_loader.hf import read_config_json, read_hf_config
from jvllm.model_loader.loader import expected_dtype, load_engine_model
from jvllm.models.model import takes_images
from jvllm.quantization import describe_weights
from jvllm.worker.compilation_cache import enable_compilation_cache
from jvllm.worker.device_sleep import DeviceSleep
from jvllm.worker.draft_model import check_draft, load_draft
from jvllm.worker.kv_budget import probe_memory, size_kv_cache
from jvllm.worker.kv_layout import kv_cache_spec
from jvllm.worker.rank_group import RankGroupRunner
from jvllm.worker.rank_runner import RankRunner

logger = init_logger(__name__)


def runs_moe_across_ranks(config: EngineConfig) -> bool:
    """Whether data parallelism runs one group of ranks whose MoE layers reach across them:
    data_parallel_size > 1 with enable_expert_parallel, for a checkpoint directory whose
    config.json has routed experts. Otherwise (a dense model; a GGUF file) the ranks are
    independent replicas, each with its own experts as enable_expert_parallel places them."""
    load, parallel = config.load_config, config.parallel_config
    if parallel.data_parallel_size == 1 or not parallel.enable_expert_parallel:
        return False
    model = load.model
    if model is None or not os.path.isfile(os.path.join(model, "config.json")):
        return False
    return read_hf_config(model, overrides=load.hf_overrides).num_experts > 0


class RankGroupWorker:
    def __init__(self, config: EngineConfig):
        """Load the model of `config` (data_parallel_size D, enable_expert_parallel) onto the
        D x T mesh; `self.config` is `config` resolved against the model, for every rank."""
        keep_freed_memory()  # before anything starts JAX's threads
        load, runner = config.load_config, config.runner_config
        self.generation_config = load_generation_config(
            load.generation_config, load.model, load.override_generation_config
        )
        enable_compilation_cache()
        start = time.perf_counter()
        backend = runner.attention_backend or default_backend()
        dtype = expected_dtype(load.model, load.dtype, load.hf_overrides)
        prepare_backend(backend, runner.kv_cache_dtype, runner.block_size, dtype)
        parallel = config.parallel_config
        self.mesh = rank_group_mesh(parallel.data_parallel_size, parallel.tensor_parallel_size)
        model_config, self.params, self.tokenizer = load_engine_model(
            load, self.mesh, enable_expert_parallel=True
        )
        # A draft model or head, its experts placed over the group's devices as the target's.
        self.draft = load_draft(config.speculative_config, load, model_config, self.mesh, True)
        self.load_seconds = time.perf_counter() - start
        if takes_images(model_config):
            raise ValueError(
                f"{model_config.architecture} takes images, which data-parallel ranks whose "
                "MoE layers run across them do not yet; leave enable_expert_parallel off"
            )
        model_config = choose_all2all_backend(
            model_config, self.mesh, parallel.all2all_backend, runner.max_num_batched_tokens
        )
        if self.draft is not None:  # an MoE draft's (an MTP layer's) exchange: the target's
            backend_chosen = model_config.all2all_backend
            draft_config = dataclasses.replace(self.draft.config, all2all_backend=backend_chosen)
            self.draft = dataclasses.replace(self.draft, config=draft_config)
        max_model_len = model_config.checked_max_model_len(load.max_model_len)
        self.model_config = model_config.for_max_model_len(max_model_len)
        # A pooling model's config.json as a dict, as Worker.hf_config (the group is of a
        # checkpoint directory: runs_moe_across_ranks); None for a generating one.
        self.hf_config = None
        if load.runner == "pooling":
            self.hf_config = read_config_json(load.model, load.hf_overrides)
        else:
            self.model_config.check_can_generate()
        self.config = config.resolved(
            max_model_len, backend, layer_windows=model_config.layer_windows
        )
        if self.draft is not None:
            groups = self.config.cache_config.kv_groups
            check_draft(
                self.model_config, self.draft, groups is not None and groups.windows != (None,)
            )
        self.num_blocks = self._size_kv_cache()
        self.runner: RankGroupRunner | None = None
        self.device_sleep: DeviceSleep | None = None  # the runner's, once it is made
        # The ranks that sleep whole (weights and KV cache) -> the level each slept at.
        self.ranks_asleep: dict[int, int] = {}

    def _size_kv_cache(self) -> int:
        """Each rank's KV pool (null block included), its T devices holding it; on a CPU
        whose host memory every rank's devices share (one process), 1/D of what one rank
        would get."""
        config, runner = self.config, self.config.runner_config
        spec = kv_cache_spec(
            self.model_config.dtype, runner.attention_backend, runner.kv_cache_dtype
        )
        num_ranks, num_shards = self.mesh.devices.shape
        probe, cache = probe_memory(), config.cache_config
        size = size_kv_cache(
            cache,
            runner,
            self.model_config,
            spec,
            config.max_model_len,
            probe,
            num_shards,
            self.draft and self.draft.config,
        )
        num_blocks = size.num_blocks
        is_sized = cache.num_gpu_blocks_override is not None or cache.kv_cache_memory_bytes
        if probe.backend == "cpu" and not is_sized and jax.process_count() == 1:
            num_blocks = max(num_blocks // num_ranks, 2)
        logger.info(
            "loaded %s (%s) in %.1fs%s; %d data-parallel ranks whose MoE layers run across "
            "them, each a KV pool of %d blocks",
            config.load_config.model or "the default model",
            describe_weights(self.params, self.model_config.dtype),
            self.load_seconds,
            describe_placement(self.mesh, self.params, self.model_config),
            num_ranks,
            num_blocks,
        )
        return num_blocks

    def group_runner(self) -> RankGroupRunner:
        """The group's runner, made on the first rank's call; the params go over to it."""
        if self.runner is None:
            params, self.params = self.params, None
            self.runner = RankGroupRunner(
                adapter_config(self.model_config, self.config.lora_config),
                params,
                self.config.runner_config,
                num_blocks=self.num_blocks,
                mesh=self.mesh,
                kv_groups=self.config.cache_config.kv_groups,
                draft=self.draft,
            )
            self.draft = None  # the runner holds it
            self.device_sleep = DeviceSleep(self.runner, self.model_config)
        return self.runner

    def compile_all(self) -> None:
        """Compile every bucket's group step where `compile_all_buckets` (once, for every
        rank; in the foreground: the processes of a group compile alike)."""
        runner = self.group_runner()
        if not self.config.runner_config.compile_all_buckets or runner.num_compilations:
            return
        seconds = runner.compile_all()
        logger.info(
            "compiled the group's step for %d buckets in %.1fs", runner.num_compilations, seconds
        )

    def rank_worker(self, rank: int) -> RankWorker:
        return RankWorker(self, rank)


class RankWorker:
    """Rank `rank`'s Worker, as its LLMEngine uses one: the group's resolved config, model and
    tokenizer, its own KV pool's size, and its view of the group's runner."""

    draft = None

    def __init__(self, group: RankGroupWorker, rank: int):
        self.group, self.rank = group, rank
        self.config = group.config
        self.model_config = group.model_config
        self.tokenizer = group.tokenizer
        self.generation_config = group.generation_config
        self.hf_config = group.hf_config
        self.load_seconds = group.load_seconds
        self.model_runner: RankRunner | None = None

    def determine_num_blocks(self) -> int:
        return self.group.num_blocks

    def initialize_runner(self, num_blocks: int) -> RankRunner:
        self.model_runner = self.group.group_runner().rank_runner(self.rank)
        return self.model_runner

    def compile_or_warm_up_model(self) -> None:
        self.group.compile_all()

    def drop_images(self, hashes: list[str]) -> None:
        """Images are refused across ranks: none to drop."""

    # The device half of sleep mode, which engine/sleep.py drives for this rank's engine. The
    # ranks share the group's params and KV cache: the group frees them once every rank of this
    # process sleeps (so every rank is idle: a sleeping engine takes no request; across
    # processes each one's rank sleeps as process 0's does), and brings each back as soon as
    # one rank wakes it.

    def has_quantized_weights(self) -> bool:
        return self.group.device_sleep.has_quantized_weights()

    def sleep(self, level: int) -> None:
        asleep = self.group.ranks_asleep
        asleep[self.rank] = level
        if len(asleep) == len(self.group.runner.local_ranks):
            self.group.device_sleep.sleep(min(asleep.values()))  # any rank's level 1 keeps them

    def missing_params(self) -> list[str]:
        return self.group.device_sleep.missing_params()

    def wake_up_weights(self) -> None:
        self.group.ranks_asleep.pop(self.rank, None)
        self.group.device_sleep.wake_up_weights()

    def wake_up_kv_cache(self) -> None:
        self.group.ranks_asleep.pop(self.rank, None)
        self.group.device_sleep.wake_up_kv_cache()

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Into the group's params, which every rank runs (each rank's engine resets its own
        prefix cache)."""
        return self.group.device_sleep.load_weights(weights)
