"""Sizing the KV cache: options, the device's memory stats, the host's free memory."""

import dataclasses
import logging

import jax
import pytest

from jvllm import LLM
from jvllm.attention.backends import default_backend
from jvllm.benchmarks import mla as mla_benchmark
from jvllm.core.kv_groups import kv_cache_groups
from jvllm.engine.arg_utils import EngineArgs
from jvllm.entrypoints.cli import build_parser
from jvllm.entrypoints.engine_flags import engine_kwargs
from jvllm.model_loader.hf import read_hf_config
from jvllm.model_loader.loader import load_model
from jvllm.sample.plan import SamplerPlan
from jvllm.worker.buckets import SPECULATIVE_MIN_TOKENS, BucketSpec
from jvllm.worker.kv_budget import (
    CPU_KV_CACHE_CAP_BYTES,
    MemoryProbe,
    activation_reserve_bytes,
    device_budget,
    host_budget,
    kv_bytes_per_block,
    largest_step,
    meminfo_available_bytes,
    size_kv_cache,
)
from jvllm.worker.kv_layout import kv_cache_spec
from jvllm.worker.model_runner import ModelRunner
from jvllm.worker.step_compiler import StepCompiler, StepLayout

GIB = 1 << 30
F32 = kv_cache_spec("float32", "reference")  # 4 bytes a value
TINY_2L = "jvllm/benchmarks/model_configs/tiny-2l"
MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:   {available} kB
Buffers:           10000 kB
"""


def _size_kv_cache(args: EngineArgs, *rest):
    """size_kv_cache over the configs that `args` make."""
    engine_config = args.create_engine_config()
    return size_kv_cache(engine_config.cache_config, engine_config.runner_config, *rest)


@pytest.fixture(scope="module")
def config():
    return read_hf_config(TINY_2L, "float32")


def _gpu(bytes_limit: int, bytes_in_use: int) -> MemoryProbe:
    return MemoryProbe("gpu", {"bytes_limit": bytes_limit, "bytes_in_use": bytes_in_use}, "")


def _cpu(available_bytes: int) -> MemoryProbe:
    return MemoryProbe("cpu", None, MEMINFO.format(available=available_bytes // 1024))


def test_device_budget_is_the_utilization_of_the_limit_less_weights_and_reserve():
    budget = device_budget({"bytes_limit": 80 * GIB, "bytes_in_use": 16 * GIB}, 0.9, GIB)
    assert budget.num_bytes == int(0.9 * 80 * GIB) - 17 * GIB
    assert "gpu_memory_utilization=0.9 of 80.0 GiB" in budget.source
    assert "16.0 GiB in use" in budget.source


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": 1}])
def test_a_device_without_memory_stats_asks_for_an_explicit_size(stats):
    with pytest.raises(ValueError, match="kv_cache_memory_bytes or num_gpu_blocks_override"):
        device_budget(stats, 0.9, 0)


def test_gpu_blocks_fill_the_budget(config):
    args = EngineArgs(max_num_seqs=8, max_num_batched_tokens=256)
    max_model_len = 1 << 20  # long enough that 8 of them need more than the device has
    size = _size_kv_cache(args, config, F32, max_model_len, _gpu(GIB, GIB // 8))
    reserve = activation_reserve_bytes(config, 256, 8)
    per_block = kv_bytes_per_block(config, 16, F32)
    assert size.num_blocks == (int(0.9 * GIB) - GIB // 8 - reserve) // per_block
    assert size.num_bytes == size.num_blocks * per_block
    assert size.source.startswith("gpu_memory_utilization=0.9 of 1.0 GiB")


def test_override_beats_the_byte_option_which_beats_the_device(config):
    no_stats = MemoryProbe("gpu", None, "")
    per_block = kv_bytes_per_block(config, 16, F32)
    both = EngineArgs(num_gpu_blocks_override=7, kv_cache_memory_bytes=100 * per_block)
    size = _size_kv_cache(both, config, F32, 512, no_stats)
    assert (size.num_blocks, size.source) == (7, "num_gpu_blocks_override=7")
    given = EngineArgs(kv_cache_memory_bytes=100 * per_block + 5)
    size = _size_kv_cache(given, config, F32, 512, no_stats)
    assert size.num_blocks == 100
    assert size.source == f"kv_cache_memory_bytes={100 * per_block + 5}"
    with pytest.raises(ValueError, match="no memory stats"):
        _size_kv_cache(EngineArgs(), config, F32, 512, no_stats)


def test_an_exact_block_count_may_be_smaller_than_one_request(config):
    size = _size_kv_cache(EngineArgs(num_gpu_blocks_override=2), config, F32, 512, _cpu(GIB))
    assert size.num_blocks == 2


def test_a_budget_below_one_max_model_len_request_says_what_is_needed_and_what_to_change(config):
    per_block = kv_bytes_per_block(config, 16, F32)
    # 512 tokens = 32 blocks, and the null block.
    args = EngineArgs(kv_cache_memory_bytes=20 * per_block)
    with pytest.raises(ValueError) as error:
        _size_kv_cache(args, config, F32, 512, _cpu(GIB))
    message = str(error.value)
    assert "max_model_len=512" in message and "33 blocks of 16 tokens" in message
    assert "the largest max_model_len is 304" in message  # 19 blocks besides the null block
    assert "increasing kv_cache_memory_bytes or decreasing max_model_len" in message
    full = _gpu(GIB, GIB)  # the weights take the whole device
    with pytest.raises(ValueError, match="increasing gpu_memory_utilization") as error:
        _size_kv_cache(EngineArgs(), config, F32, 512, full)
    assert "the largest max_model_len" not in str(error.value)


def test_a_budget_beyond_every_sequence_at_full_length_is_capped(config):
    args = EngineArgs(max_num_seqs=4)
    size = _size_kv_cache(args, config, F32, 512, _gpu(80 * GIB, 0))
    assert size.num_blocks == 4 * 32 + 1
    assert "capped at max_num_seqs=4 requests of max_model_len=512" in size.source


def test_meminfo_gives_memavailable_in_bytes():
    assert meminfo_available_bytes(MEMINFO.format(available=2048)) == 2048 * 1024
    with pytest.raises(ValueError, match="MemAvailable"):
        meminfo_available_bytes("MemTotal:       24576000 kB\n")
    with pytest.raises(ValueError, match="MemAvailable"):
        meminfo_available_bytes("")


def test_cpu_budget_is_half_the_free_memory_up_to_the_cap():
    meminfo = MEMINFO.format(available=(20 * GIB) // 1024)
    big = host_budget(meminfo, reserve_bytes=GIB, needed_bytes=1)
    assert big.num_bytes == CPU_KV_CACHE_CAP_BYTES
    assert big.source.startswith("CPU free memory: 20.0 GiB available, less 1.0 GiB")
    meminfo = MEMINFO.format(available=(GIB // 2) // 1024)
    small = host_budget(meminfo, reserve_bytes=GIB // 4, needed_bytes=1)
    assert small.num_bytes == GIB // 8


def test_cpu_budget_grows_to_one_request_where_free_memory_holds_it():
    meminfo = MEMINFO.format(available=(4 * GIB) // 1024)
    grown = host_budget(meminfo, reserve_bytes=GIB, needed_bytes=2 * GIB)
    assert grown.num_bytes == 2 * GIB and "raised to one request" in grown.source
    short = host_budget(meminfo, reserve_bytes=GIB, needed_bytes=4 * GIB)
    assert short.num_bytes == 3 * GIB  # all that is left: too little, size_kv_cache refuses


def test_cpu_with_too_little_free_memory_refuses_to_start(config):
    with pytest.raises(ValueError, match="freeing host memory or decreasing max_model_len"):
        _size_kv_cache(
            EngineArgs(), config, F32, 512, _cpu(activation_reserve_bytes(config, 2048, 128))
        )


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.01, float("nan"), True, "0.9", None])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a float in \(0, 1\]"):
        EngineArgs(gpu_memory_utilization=value)


def test_gpu_memory_utilization_is_a_serve_flag():
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.5"])
    assert engine_kwargs(args)["gpu_memory_utilization"] == 0.5
    assert EngineArgs(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_engine_sizes_its_cache_from_kv_cache_memory_bytes(tiny_llama_weights_dir, monkeypatch):
    records = []  # jvllm's loggers do not propagate to the root
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(logging.getLogger("jvllm.worker.worker"), "handlers", [handler])

    def kv_line() -> str:
        (line,) = [r.getMessage() for r in records if "KV cache:" in r.getMessage()]
        records.clear()
        return line

    kwargs = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 4}
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # L * (K, V) * K heads * B * H * float32
    llm = LLM(tiny_llama_weights_dir, kv_cache_memory_bytes=20 * per_block + 100, **kwargs)
    assert llm.llm_engine.model_runner.kv_cache.shape[3] == 20
    assert llm.llm_engine.scheduler.kv_cache_manager.num_usable_blocks == 19
    line = kv_line()
    assert "KV cache: float32 at 512 bytes a token, 20 blocks of 16 tokens = 304 tokens" in line
    assert f"from kv_cache_memory_bytes={20 * per_block + 100})" in line
    default = LLM(tiny_llama_weights_dir, **kwargs)
    assert default.llm_engine.model_runner.kv_cache.shape[3] == 4 * 8 + 1
    line = kv_line()
    assert "from CPU free memory" in line and "capped at max_num_seqs=4" in line
    # int8: 16 one-byte values and a 2-byte scale a head, 144 bytes a token against 512.
    kwargs["max_num_seqs"] = 16  # a cap above the budget's blocks
    quantized = LLM(
        tiny_llama_weights_dir,
        kv_cache_dtype="int8",
        kv_cache_memory_bytes=20 * per_block + 100,
        **kwargs,
    )
    kv_cache = quantized.llm_engine.model_runner.kv_cache
    assert kv_cache.values.shape[3] == kv_cache.scales.shape[3] == (20 * per_block + 100) // 2304
    assert (
        "KV cache: int8 (int8 values, a bfloat16 scale a token and KV head) at 144 bytes a "
        "token, 71 blocks of 16 tokens" in kv_line()
    )


@pytest.mark.parametrize(
    "model_dtype,kv_cache_dtype,ratio",
    [
        ("bfloat16", "fp8", 128 / 66),  # SmolLM2's H = 64: 2 * 64 bytes against 64 + 2
        ("bfloat16", "int8", 128 / 66),
        ("float32", "fp8_e4m3", 256 / 66),
    ],
)
def test_a_one_byte_cache_holds_about_twice_the_blocks_of_bfloat16(
    model_dtype, kv_cache_dtype, ratio
):
    config = read_hf_config("jvllm/benchmarks/model_configs/smollm2-135m", model_dtype)
    args = EngineArgs(kv_cache_memory_bytes=GIB, max_num_seqs=1024)
    auto, quantized = (
        _size_kv_cache(args, config, kv_cache_spec(model_dtype, "pallas", kind), 512, _cpu(GIB))
        for kind in ("auto", kv_cache_dtype)
    )
    # L * (K, V) * K heads * B * (H one-byte values + a bfloat16 scale)
    assert quantized.num_blocks == GIB // (30 * 2 * 3 * 16 * (64 + 2))
    assert quantized.num_blocks / auto.num_blocks == pytest.approx(ratio, rel=1e-3)


@pytest.mark.parametrize("value", ["fp16", "float8", "FP8", None])
def test_a_bad_kv_cache_dtype_names_the_field_and_the_allowed_values(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'"):
        EngineArgs(kv_cache_dtype=value)


def test_kv_cache_dtype_is_a_serve_flag():
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize(
    "model,dtype,num_tokens,num_seqs,overrides,num_drafts",
    [
        (TINY_2L, "float32", 256, 32, None, 0),  # the sampler's [S, V] arrays dominate
        # and with 3 drafts a request it samples their positions too, 4 S rows: the largest
        # bucket's 239 MB outgrew a reserve of S rows (215 MB)
        (TINY_2L, "float32", 256, 64, None, 3),
        pytest.param(  # one layer's activations dominate
            "jvllm/benchmarks/model_configs/smollm2-135m",
            "bfloat16",
            8192,
            8,
            None,
            0,
            marks=pytest.mark.slow,
        ),
        pytest.param(  # MLA's latent path: 128 heads of 576 dims
            mla_benchmark.MODEL_DIR,
            "bfloat16",
            1024,
            8,
            mla_benchmark.shrunk_overrides(2),
            0,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_activation_reserve_bounds_the_compiled_steps_temporaries(
    model, dtype, num_tokens, num_seqs, overrides, num_drafts
):
    """The reserve is a formula: it must stay above what XLA says the largest buckets need."""
    config, params, _ = load_model(model, dtype, "dummy", hf_overrides=overrides)
    speculative = {"method": "ngram", "num_speculative_tokens": num_drafts} if num_drafts else None
    args = EngineArgs(
        max_num_batched_tokens=num_tokens, max_num_seqs=num_seqs, speculative_config=speculative
    )
    engine_config = args.create_engine_config().resolved(num_tokens, default_backend())
    runner = ModelRunner(config, params, engine_config.runner_config, num_blocks=8)
    buckets = runner.buckets.all_buckets()
    largest_decode = max(b for b in buckets if b.is_decode)
    reserve = activation_reserve_bytes(config, *largest_step(engine_config.runner_config))
    for bucket in (largest_decode, buckets[-1]):
        analysis = runner.compiler.compile((bucket, "step", SamplerPlan.DYNAMIC)).memory_analysis()
        if analysis is None:
            pytest.skip(f"XLA gives no memory analysis on {jax.default_backend()}")
        assert analysis.temp_size_in_bytes <= reserve, bucket


def test_the_largest_max_model_len_counts_the_windowed_groups_pages(config):
    """Hybrid KV groups (core/kv_groups.py): a request holds its full group's pages and its
    windowed groups' too, so the length a too-small cache suggests is what those fit."""
    per_block = kv_bytes_per_block(config, 16, F32, num_slots=1)
    args = EngineArgs(kv_cache_memory_bytes=20 * per_block, max_num_batched_tokens=16)
    engine_config = args.create_engine_config()
    cache = dataclasses.replace(engine_config.cache_config, kv_groups=kv_cache_groups((None, 16)))
    with pytest.raises(ValueError) as error:
        size_kv_cache(cache, engine_config.runner_config, config, F32, 512, _cpu(GIB))
    # 19 blocks besides the null block: 256 tokens' 16 and the window's 3 (304 would need 22).
    assert "the largest max_model_len is 256" in str(error.value)


@pytest.mark.parametrize("num_tokens", [64, 72, 256])
def test_the_largest_step_counts_the_largest_window_of_speculative_rounds(num_tokens):
    runner = dataclasses.replace(
        EngineArgs().create_engine_config().runner_config,
        max_num_batched_tokens=num_tokens,
        max_num_seqs=64,
        num_speculative_tokens=3,
        num_scheduler_steps=4,
    )
    spec = BucketSpec(num_tokens, 64, min_mixed_tokens=SPECULATIVE_MIN_TOKENS)
    layout = StepLayout(16, 8, 100, False, num_speculative_tokens=3)
    compiler = StepCompiler(spec, None, None, layout, num_scheduler_steps=4)
    largest = max(bucket.num_tokens for bucket, _, _ in compiler.all_shapes())
    assert largest_step(runner) == (largest, 64, 64 + min(largest, 64 * 3))
