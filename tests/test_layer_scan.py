"""The model's layer scan against the same layers written out one by one (float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from conftest import dense_forward_logits
from test_model_numerics import TINY, _save_random_model

from jvllm.model_loader.hf import load_hf_dir
from jvllm.models import llama

_PADDED_LEN = 48  # causal attention: tokens past a sequence's end do not change its logits


def _unrolled_forward(params, kv_cache, token_ids, positions, metadata, *, config, attn):
    """`llama.forward` with a Python loop over the layers: the layout the scan replaced."""
    x = llama._embed(params.embed, token_ids)
    cos, sin = llama.rope_cos_sin(positions, config)
    for layer in range(config.num_layers):
        lp = jax.tree.map(lambda w, i=layer: w[i], params.layers)
        x, kv_cache = llama._decoder_layer(
            x, kv_cache, lp, jnp.int32(layer), cos, sin, metadata, config, attn
        )
    return llama.rms_norm(x, params.final_norm, config.rms_norm_eps), kv_cache


def _greedy(forward, config, params, prompt, num_tokens):
    """Greedy decode by recomputing the padded sequence each token -> (tokens, last logits)."""

    @jax.jit
    def logits_at(params, token_ids, last):
        positions = jnp.arange(_PADDED_LEN, dtype=jnp.int32)
        logits = dense_forward_logits(
            params, token_ids, positions, config=config, forward_fn=forward
        )  # [T, V]
        return logits[last]

    tokens = list(prompt)
    for _ in range(num_tokens):
        padded = np.zeros(_PADDED_LEN, np.int32)
        padded[: len(tokens)] = tokens
        logits = np.asarray(logits_at(params, padded, len(tokens) - 1))
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :], logits


def _assert_scan_matches_unrolled(config, params, prompt):
    scanned, scanned_logits = _greedy(llama.forward, config, params, prompt, 12)
    unrolled, unrolled_logits = _greedy(_unrolled_forward, config, params, prompt, 12)
    assert scanned == unrolled
    np.testing.assert_allclose(
        scanned_logits, unrolled_logits, rtol=1e-5, atol=1e-4
    )  # fusion order


def test_scanned_layers_match_unrolled_on_a_tiny_model(tmp_path):
    _save_random_model(tmp_path, transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 3}))
    config, params = load_hf_dir(str(tmp_path), "float32")
    assert params.layers.qkv.shape[0] == 3
    _assert_scan_matches_unrolled(config, params, [5, 17, 200, 3, 99])


def test_scanned_layers_match_unrolled_on_the_default_model(smollm2_dir):
    config, params = load_hf_dir(smollm2_dir, "float32")
    prompt = [1, 9690, 198, 2683, 314, 253, 5356, 11173, 30]  # a chat turn's opening tokens
    _assert_scan_matches_unrolled(config, params, prompt)
