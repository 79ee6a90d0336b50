"""The layers' weights as one array per layer (layers/scan.py's unstack_layers: the layout the
engine uses on a GPU, forced here on CPU) decode like HF transformers, as the stacked scan does;
the split frees the stacked arrays and the setting is checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from family_parity import assert_matches_hf, ragged_prompts, save_random_model

from jvllm import LLM, SamplingParams
from jvllm.layers.scan import (
    UNSTACKED_LAYERS_ENV,
    _split_array,
    is_unstacked,
    unstack_layers,
    use_unstacked_layers,
)
from jvllm.model_loader.hf import load_hf_dir
from jvllm.models.model import param_axes
from jvllm.quantization import is_quantized

TINY = {
    "num_hidden_layers": 3,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
PROMPTS = ragged_prompts(TINY["vocab_size"])


def _paths(tree) -> dict:
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_quantized(x) or is_unstacked(x)
    )
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def test_unstack_layers_splits_each_layers_param_and_frees_the_stack(tmp_path):
    save_random_model(tmp_path, transformers.LlamaConfig(**TINY))
    config, params = load_hf_dir(str(tmp_path), "float32")
    before = _paths(params)
    copies = {path: np.asarray(leaf) for path, leaf in before.items()}
    after = _paths(unstack_layers(params, param_axes(config)))
    assert set(after) == set(before)
    for path, leaf in after.items():
        if path.startswith("['layers']"):
            assert is_unstacked(leaf) and len(leaf.layers) == TINY["num_hidden_layers"]
            for i, layer in enumerate(leaf.layers):
                np.testing.assert_array_equal(np.asarray(layer), copies[path][i])
            assert before[path].is_deleted()
        else:
            assert leaf is before[path]


@pytest.mark.parametrize("through_host", [False, True], ids=["on_the_device", "through_host"])
def test_split_array_gives_each_layer_and_deletes_the_stack(through_host):
    """Both ways of splitting (a GPU's goes through host memory) give the same layers."""
    x = jnp.arange(3 * 4 * 5, dtype=jnp.bfloat16).reshape(3, 4, 5)
    expected, sharding = np.asarray(x), x.sharding
    layers = _split_array(x, through_host)
    assert x.is_deleted()
    assert [layer.sharding for layer in layers] == [sharding] * 3
    for layer, want in zip(layers, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(layer), want)


@pytest.mark.parametrize(
    "hf_config",
    [
        transformers.MistralConfig(**TINY, sliding_window=8),
        pytest.param(  # slow: Mistral's windows and Mixtral's experts keep the default run's
            transformers.Gemma2Config(
                **{**TINY, "num_hidden_layers": 4},
                sliding_window=8,
                query_pre_attn_scalar=64,
                attn_logit_softcapping=3.0,
                attn_implementation="eager",
            ),
            marks=pytest.mark.slow,
        ),
        transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
        pytest.param(
            transformers.GPT2Config(
                n_layer=3, n_embd=64, n_head=4, vocab_size=TINY["vocab_size"], n_positions=512
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["mistral_window", "gemma2_alternate_windows", "mixtral_experts", "gpt2"],
)
def test_unstacked_layers_decode_like_hf(tmp_path, monkeypatch, hf_config):
    """Per-layer windows (every layer's, alternate layers') are sliced with the weights; an
    MoE's experts ([L, E, ...]) split by layer alone; GPT-2's layers have biases and norms."""
    monkeypatch.setenv(UNSTACKED_LAYERS_ENV, "1")
    hf_model = save_random_model(tmp_path, hf_config)
    assert_matches_hf(tmp_path, hf_model, PROMPTS, block_size=4)


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"quantization": "int8"},
        {"num_scheduler_steps": 4},
        {"async_scheduling": True},
        {"attention_backend": "pallas", "block_size": 8},
    ],
    ids=["bfloat16", "int8", "decode_windows", "async_scheduling", "pallas"],
)
def test_unstacked_engine_matches_the_stacked_scan(tmp_path, monkeypatch, setting):
    """Same tokens and logprobs; int8 weights are split field by field (values and scales),
    decode windows and steps run ahead carry the split params too, and the Pallas kernels (a
    GPU's backend, in interpret mode here) take each layer's index as a constant."""
    save_random_model(tmp_path, transformers.LlamaConfig(**TINY))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    # No prefix cache: the measured run computes the prompts again, as the first did.
    kwargs = {"dtype": "bfloat16", "max_num_seqs": 8, "enable_prefix_caching": False, **setting}
    results = {}
    for split in ("0", "1"):
        monkeypatch.setenv(UNSTACKED_LAYERS_ENV, split)
        llm = LLM(str(tmp_path), **kwargs)
        runner = llm.llm_engine.model_runner
        assert runner.layers_unstacked == (split == "1")
        leaves = jax.tree.leaves(runner.params["layers"], is_leaf=is_unstacked)
        assert all(is_unstacked(leaf) for leaf in leaves) == (split == "1")
        inputs = [{"prompt_token_ids": p} for p in PROMPTS]
        # Measured once the first run's compiles are done (background ones too, where they
        # run): a step lent a larger bucket while its own compiles pads differently, which
        # moves bfloat16's logprobs in their third digit, split or not.
        llm.generate(inputs, params, use_tqdm=False)
        runner.compiler.executables.wait_all()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        results[split] = [
            (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for o in outputs
            for c in o.outputs
        ]
    for (ids0, lps0), (ids1, lps1) in zip(results["0"], results["1"], strict=True):
        assert ids0 == ids1
        np.testing.assert_allclose(lps0, lps1, atol=1e-5)


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv(UNSTACKED_LAYERS_ENV, "yes")
    with pytest.raises(ValueError, match=f"{UNSTACKED_LAYERS_ENV}='yes'; allowed"):
        use_unstacked_layers()
    monkeypatch.delenv(UNSTACKED_LAYERS_ENV)
    assert use_unstacked_layers() == (jax.default_backend() == "gpu")
