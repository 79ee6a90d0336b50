"""The Worker (vLLM's): everything on the device side of one engine. It loads the model (and
new weights into it), builds the mesh, sizes the KV cache, starts the native kernels' build,
turns on the compilation cache, makes the model runner, compiles its steps up front or in the
background, and frees and refills the device for sleep mode. LLMEngine keeps the host side
(scheduler, outputs) and reaches the device only through this.

Start-up runs in vLLM's order: `Worker(config)` loads the model, `determine_num_blocks()`
sizes the cache from what is left, `initialize_runner(num_blocks)` allocates it beside the
params, and `compile_or_warm_up_model()` compiles."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from jvllm.attention.backends import default_backend, prepare_backend
from jvllm.core.engine_config import EngineConfig
from jvllm.core.kv_groups import KVCacheGroups
from jvllm.cpu_malloc import keep_freed_memory
from jvllm.distributed.mesh import describe_placement, engine_mesh
from jvllm.logger import init_logger
from jvllm.lora.config import adapter_config
from jvllm.model_loader.generation_config import load_generation_config
from jvllm.model_loader.hf import read_config_json
from jvllm.model_loader.loader import (
    expected_dtype,
    is_prequantized,
    load_engine_model,
    resolve_quantization,
)
from jvllm.models.model import image_num_embeds, takes_images
from jvllm.quantization import build_kernels_early, describe_weights
from jvllm.worker.compilation_cache import enable_compilation_cache
from jvllm.worker.device_sleep import DeviceSleep
from jvllm.worker.draft_model import check_draft, load_draft
from jvllm.worker.executables import BACKGROUND_COMPILES_ENV
from jvllm.worker.kv_budget import probe_memory, size_kv_cache
from jvllm.worker.kv_layout import kv_cache_spec
from jvllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


class Worker:
    def __init__(self, config: EngineConfig):
        """Load the model that `config` names onto this engine's devices. `self.config` is
        `config` resolved against the model (its max_model_len, the attention backend)."""
        keep_freed_memory()  # before anything starts JAX's threads
        load = config.load_config
        self.generation_config = load_generation_config(
            load.generation_config, load.model, load.override_generation_config
        )
        enable_compilation_cache()  # before loading: its small jits are cached too
        self._start = time.perf_counter()
        runner = config.runner_config
        backend = runner.attention_backend or default_backend()
        self._build_kernels_early(config, backend)
        parallel = config.parallel_config
        self.mesh = engine_mesh(
            parallel.tensor_parallel_size,
            parallel.data_parallel_size,
            parallel.data_parallel_rank,
        )
        self.model_config, self.params, self.tokenizer = load_engine_model(
            load, self.mesh, parallel.enable_expert_parallel
        )
        self.draft = load_draft(
            config.speculative_config,
            load,
            self.model_config,
            self.mesh,
            parallel.enable_expert_parallel,
        )
        self.load_seconds = time.perf_counter() - self._start
        model_config = self.model_config
        max_model_len = model_config.checked_max_model_len(load.max_model_len)
        self.model_config = model_config.for_max_model_len(max_model_len)
        if load.runner != "pooling":
            self.model_config.check_can_generate()
        max_image_tokens = 0
        if takes_images(model_config):
            if load.runner == "pooling":
                raise ValueError(
                    f"runner='pooling' is not supported for {model_config.architecture}, a "
                    "model that takes images; serve it with runner='generate'"
                )
            max_image_tokens = image_num_embeds(model_config)
            if model_config.option("bidirectional_images") and backend == "pallas":
                if runner.attention_backend is not None:
                    raise ValueError(
                        f"{model_config.architecture}'s image tokens attend to their whole "
                        "image, which the 'pallas' backend's kernels do not; use "
                        "attention_backend='reference'"
                    )
                logger.info(
                    "attention backend 'reference': %s's image tokens attend to their whole "
                    "image, which the Pallas kernels do not",
                    model_config.architecture,
                )
                backend = "reference"
        whole = bool(model_config.option("bidirectional_images"))
        self.config = config.resolved(
            max_model_len, backend, max_image_tokens, whole, model_config.layer_windows
        )
        # A pooling model's config.json as a dict (vLLM's hf_config), for what the engine reads
        # from it beside the model (its matryoshka sizes); None for a GGUF, the default model,
        # or a generating engine.
        is_hf_dir = load.model is not None and os.path.isfile(
            os.path.join(load.model, "config.json")
        )
        is_pooling = load.runner == "pooling"
        self.hf_config = (
            read_config_json(load.model, load.hf_overrides) if is_pooling and is_hf_dir else None
        )
        if self.draft is not None:
            groups = self.config.cache_config.kv_groups
            has_windows = groups is not None and groups.windows != (None,)
            check_draft(self.model_config, self.draft, has_windows)
        self.model_runner: ModelRunner | None = None
        self.device_sleep: DeviceSleep | None = None  # the runner's, once it is made

    @staticmethod
    def _build_kernels_early(config: EngineConfig, backend: str) -> None:
        """Start building, in the background, the native kernels that the attention backend
        and the model dtype will use, so that tracing the first step finds them built."""
        load = config.load_config
        runner = config.runner_config
        dtype = expected_dtype(load.model, load.dtype, load.hf_overrides)
        prepare_backend(backend, runner.kv_cache_dtype, runner.block_size, dtype)
        try:
            quantization = resolve_quantization(
                load.model, load.dtype, load.quantization, load.hf_overrides
            )
            prequantized = is_prequantized(load.model, load.hf_overrides)
        except ValueError:  # the load says what is wrong
            quantization, prequantized = None, False
        build_kernels_early(quantization, dtype, prequantized)

    def determine_num_blocks(self) -> int:
        """The KV cache's block count (null block included) from the memory the loaded
        weights left (worker/kv_budget.py); logs what was loaded and the cache's size."""
        config, runner = self.config, self.config.runner_config
        spec = kv_cache_spec(
            self.model_config.dtype, runner.attention_backend, runner.kv_cache_dtype
        )
        size = size_kv_cache(
            config.cache_config,
            runner,
            self.model_config,
            spec,
            config.max_model_len,
            probe_memory(),
            self.mesh.size,
            self.draft and self.draft.config,
        )
        logger.info(
            "loaded %s (%s) in %.1fs%s; KV cache: %s",
            config.load_config.model or "the default model",
            describe_weights(self.params, self.model_config.dtype),
            self.load_seconds,
            describe_placement(self.mesh, self.params, self.model_config),
            size.describe(runner.block_size, per_device=self.mesh.size > 1)
            + _describe_groups(config.cache_config.kv_groups),
        )
        return size.num_blocks

    def initialize_runner(self, num_blocks: int) -> ModelRunner:
        """The model runner over the loaded params (with LoRA slots where enabled) and a KV
        cache of `num_blocks`; the worker hands its params over to it."""
        params, self.params = self.params, None
        self.model_runner = ModelRunner(
            adapter_config(self.model_config, self.config.lora_config),
            params,
            self.config.runner_config,
            num_blocks=num_blocks,
            mesh=self.mesh,
            kv_groups=self.config.cache_config.kv_groups,
            draft=self.draft,
        )
        self.draft = None  # the runner holds it
        self.device_sleep = DeviceSleep(self.model_runner, self.model_config)
        return self.model_runner

    def compile_or_warm_up_model(self) -> None:
        """Compile every step shape where `compile_all_buckets` (in background threads where
        `compile_in_background`, but never in lockstep with other processes, which compile in
        the same order; none where JVLLM_BACKGROUND_COMPILES=0), saying so in the log;
        otherwise each compiles on first use."""
        runner_config, runner = self.config.runner_config, self.model_runner
        if not runner_config.compile_all_buckets:
            return
        if runner_config.compile_in_background and not runner.compiler.lockstep:
            runner.compile_in_background()
            if runner.compiler.executables.background:
                what = (
                    f"compiling {len(runner.compiler.all_shapes())} executables in the background"
                )
            else:
                what = f"{BACKGROUND_COMPILES_ENV}=0: each executable compiles on first use"
            logger.info("ready after %.1fs of loading; %s", self.load_seconds, what)
            return
        compile_seconds = runner.compile_all()
        logger.info(
            "ready in %.1fs: load %.1fs, compile %.1fs (%d executables), warm-up %.1fs",
            time.perf_counter() - self._start,
            self.load_seconds,
            compile_seconds,
            runner.compiler.num_compilations,
            runner.warmup_seconds,
        )

    def drop_images(self, hashes: list[str]) -> None:
        """Forget the encoder outputs of these images (a failed step's)."""
        if self.model_runner is not None and self.model_runner.encoder is not None:
            self.model_runner.encoder.drop(hashes)

    # The device half of sleep mode (engine/sleep.py keeps the engine's half), the runner's
    # (worker/device_sleep.py).

    def has_quantized_weights(self) -> bool:
        return self.device_sleep.has_quantized_weights()

    def sleep(self, level: int) -> None:
        self.device_sleep.sleep(level)

    def missing_params(self) -> list[str]:
        return self.device_sleep.missing_params()

    def wake_up_weights(self) -> None:
        self.device_sleep.wake_up_weights()

    def wake_up_kv_cache(self) -> None:
        self.device_sleep.wake_up_kv_cache()

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        return self.device_sleep.load_weights(weights)


def _describe_groups(groups: KVCacheGroups | None) -> str:
    """The start-up log's words on hybrid KV groups (core/kv_groups.py); "" without."""
    if groups is None or groups.windows == (None,):
        return ""
    return f"; pages in {groups.describe()}, windowed groups keep their window's pages"
