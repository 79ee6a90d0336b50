"""The MoE layer (route, moe_mlp, dense_moe_mlp) against HF's Mixtral and Qwen3-MoE sparse blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from jvllm.layers.moe import dense_moe_mlp, moe_mlp, route

_D, _F, _E = 32, 64, 8
_NUM_TOKENS = 24

# (family, k, renormalize): Mixtral always renormalises; Qwen3-MoE when norm_topk_prob.
_CASES = [
    ("mixtral", 2, True),
    ("qwen3_moe", 2, True),
    ("qwen3_moe", 2, False),
    ("qwen3_moe", 4, True),
    ("qwen3_moe", 4, False),
]
_IDS = [f"{family}-k{k}-{'renorm' if renorm else 'raw'}" for family, k, renorm in _CASES]


def _hf_block(family: str, top_k: int, renormalize: bool) -> torch.nn.Module:
    """A float32 HF sparse MoE block with random weights (HF's own init leaves them empty)."""
    common = {"hidden_size": _D, "num_experts_per_tok": top_k, "experts_implementation": "eager"}
    if family == "mixtral":
        block = MixtralSparseMoeBlock(
            MixtralConfig(intermediate_size=_F, num_local_experts=_E, **common)
        )
    else:
        config = Qwen3MoeConfig(
            moe_intermediate_size=_F, num_experts=_E, norm_topk_prob=renormalize, **common
        )
        block = Qwen3MoeSparseMoeBlock(config)
    generator = torch.Generator().manual_seed(_CASES.index((family, top_k, renormalize)))
    with torch.no_grad():
        # Router rows of norm ~1 spread the softmax; expert weights of the usual init scale.
        block.gate.weight.normal_(0.0, 1.0 / _D**0.5, generator=generator)
        block.experts.gate_up_proj.normal_(0.0, 0.1, generator=generator)
        block.experts.down_proj.normal_(0.0, 0.1, generator=generator)
    return block.eval()


def _jax_weights(block: torch.nn.Module, dtype=jnp.float32) -> dict[str, jax.Array]:
    """router [E, D]; HF's fused expert tensors [E, 2F, D] (gate then up) and [E, D, F] in
    moe.py's [in, out] layout: gate_up [E, D, 2F], down [E, F, D]."""

    def array(t: torch.Tensor) -> jax.Array:
        return jnp.asarray(t.detach().numpy(), dtype)

    return {
        "router": array(block.gate.weight),
        "gate_up": array(block.experts.gate_up_proj.transpose(1, 2)),
        "down": array(block.experts.down_proj.transpose(1, 2)),
    }


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((_NUM_TOKENS, _D)).astype(np.float32)


def _by_expert(weights, experts) -> tuple[np.ndarray, np.ndarray]:
    """Each token's (experts, weights) sorted by expert id, so selections compare as sets."""
    experts, weights = np.asarray(experts), np.asarray(weights, np.float32)
    order = np.argsort(experts, axis=-1)
    return np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize(("family", "top_k", "renormalize"), _CASES, ids=_IDS)
def test_route_picks_hf_experts_with_hf_weights(family, top_k, renormalize):
    block, x = _hf_block(family, top_k, renormalize), _tokens()
    with torch.no_grad():
        _, hf_weights, hf_experts = block.gate(torch.from_numpy(x))
    weights, experts = jax.jit(route, static_argnums=(2, 3))(
        x, _jax_weights(block)["router"], top_k, renormalize
    )
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    assert weights.shape == experts.shape == (_NUM_TOKENS, top_k)
    ours_e, ours_w = _by_expert(weights, experts)
    hf_e, hf_w = _by_expert(hf_weights.numpy(), hf_experts.numpy())
    np.testing.assert_array_equal(ours_e, hf_e)
    np.testing.assert_allclose(ours_w, hf_w, rtol=1e-5, atol=1e-6)
    sums = np.asarray(weights.sum(-1))
    if renormalize:
        np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
    else:
        assert (sums < 1.0).all()  # the top-k share of the full softmax


@pytest.mark.parametrize(("family", "top_k", "renormalize"), _CASES, ids=_IDS)
def test_moe_mlp_and_dense_moe_mlp_match_hf_block(family, top_k, renormalize):
    block, x = _hf_block(family, top_k, renormalize), _tokens(1)
    with torch.no_grad():
        expected = block(torch.from_numpy(x)[None])[0].numpy()
    w = _jax_weights(block)
    weights, experts = route(x, w["router"], top_k, renormalize)
    for mlp in (moe_mlp, dense_moe_mlp):
        out = jax.jit(mlp)(x, weights, experts, w["gate_up"], w["down"])
        assert out.shape == (_NUM_TOKENS, _D) and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_moe_mlp_equals_dense_moe_mlp_when_experts_are_crowded_or_idle():
    """Every token on the same two experts leaves six groups empty; zero rows (bucket padding)
    are just more tokens."""
    w = _jax_weights(_hf_block("mixtral", 2, True))
    x = np.concatenate([_tokens(2)[:8], np.zeros((4, _D), np.float32)])
    experts = jnp.tile(jnp.asarray([[5, 2]], jnp.int32), (12, 1))
    weights = jnp.tile(jnp.asarray([[0.75, 0.25]], jnp.float32), (12, 1))
    grouped = jax.jit(moe_mlp)(x, weights, experts, w["gate_up"], w["down"])
    dense = jax.jit(dense_moe_mlp)(x, weights, experts, w["gate_up"], w["down"])
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(grouped[8:]), 0.0)


@pytest.mark.parametrize("num_tokens", [1, _NUM_TOKENS])
def test_bfloat16_weights_stay_close_to_float32_hf(num_tokens):
    block, x = _hf_block("qwen3_moe", 4, True), _tokens(3)[:num_tokens]
    with torch.no_grad():
        expected = block(torch.from_numpy(x)[None])[0].numpy()
    # The float32 router, so that both pick the same experts; the experts in bfloat16.
    weights, experts = route(x, _jax_weights(block)["router"], 4, True)
    w = _jax_weights(block, jnp.bfloat16)
    grouped = jax.jit(moe_mlp)(x, weights, experts, w["gate_up"], w["down"])
    dense = jax.jit(dense_moe_mlp)(x, weights, experts, w["gate_up"], w["down"])
    assert grouped.dtype == dense.dtype == jnp.float32
    scale = np.abs(expected).max()
    # bfloat16 keeps 8 bits of mantissa, rounded in x, the weights and the hidden activations.
    np.testing.assert_allclose(np.asarray(grouped), expected, atol=0.02 * scale)
    # The same bfloat16 products, summed in float32 in another order.
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=1e-5, atol=1e-6)
