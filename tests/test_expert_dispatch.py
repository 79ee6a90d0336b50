"""layers/expert_dispatch.py: where a rank's tokens go (each once to each row of its column
that holds any of its experts), and the exchange over R ranks x T columns (named vmap axes,
run as over devices) giving each rank the experts' sum of its own tokens, an idle rank's too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.layers import expert_dispatch
from jvllm.layers.expert_dispatch import dispatch_layout, dispatch_over_ranks
from jvllm.layers.params import DP_AXIS, TP_AXIS
from jvllm.layers.ragged_all_to_all import dense_ragged_all_to_all

# Jitted: eagerly each of its ops compiles alone (seconds).
_layout = jax.jit(dispatch_layout, static_argnames=("num_local_experts", "num_ranks", "num_shards"))


def test_a_token_goes_once_to_a_row_holding_several_of_its_experts():
    """2 ranks of 1 device, 2 experts each: token 0's experts both lie on row 0, token 2's
    both on row 1, token 1 has one on each."""
    experts = jnp.array([[0, 1], [1, 2], [3, 2]], jnp.int32)
    layout = _layout(experts, num_local_experts=2, num_ranks=2, num_shards=1, column=0)
    assert layout.send_sizes.tolist() == [2, 2]
    assert layout.input_offsets.tolist() == [0, 2]
    assert layout.slot_tokens.shape == (6,)  # min(k, R) T slots
    assert layout.slot_tokens[:4].tolist() == [0, 1, 1, 2]
    routes = [[True, True], [True, False], [False, True], [True, True]]
    assert layout.slot_routes[:4].tolist() == routes


def test_a_device_sends_only_its_own_columns_assignments():
    """2 ranks x 2 columns, one expert a device (expert e on row e // 2, column e % 2): column
    0 sends token 0 (experts 0 and 1) to row 0 for expert 0 alone, and token 1 (experts 3 and
    1) nowhere; column 1 sends token 0 to row 0 and token 1 to rows 0 and 1."""
    experts = jnp.array([[0, 1], [3, 1]], jnp.int32)
    left = _layout(experts, num_local_experts=1, num_ranks=2, num_shards=2, column=0)
    assert left.send_sizes.tolist() == [1, 0]
    assert left.slot_tokens[0] == 0 and left.slot_routes[0].tolist() == [True, False]
    right = _layout(experts, num_local_experts=1, num_ranks=2, num_shards=2, column=1)
    assert right.send_sizes.tolist() == [2, 1]
    assert right.slot_tokens[:3].tolist() == [0, 1, 1]
    assert right.slot_routes[:3].tolist() == [[False, True], [False, True], [True, False]]


def _experts(x, weights, experts, w, first, num_local):
    """A device's experts (x @ w[e], the ids first .. first + num_local - 1) on its routes."""
    held = (experts >= first) & (experts < first + num_local)
    out = jnp.einsum("td,tkdo->tko", x, w[jnp.clip(experts, 0, w.shape[0] - 1)])
    return jnp.einsum("tko,tk->to", jnp.where(held[..., None], out, 0.0), weights)


@pytest.mark.parametrize(("num_ranks", "num_shards"), [(2, 1), (2, 2), (4, 1)])
def test_each_rank_gets_its_tokens_experts_summed(monkeypatch, num_ranks, num_shards):
    """Random routes of 5 tokens a rank (k = 3 of 8 experts, rank 1's tokens all padding of
    id 0, as an idle rank's are): each rank's columns' outputs sum to its tokens' experts.
    Under jit, with the CPU's blocks in place of ragged_all_to_all's platform switch, whose
    native branch jax would trace under vmap too (it has no batching rule)."""
    monkeypatch.setattr(expert_dispatch, "ragged_all_to_all", dense_ragged_all_to_all)
    rng = np.random.default_rng(num_ranks + num_shards)
    num_tokens, top_k, hidden = 5, 3, 4
    num_experts = 8
    num_local = num_experts // (num_ranks * num_shards)
    w = jnp.asarray(rng.normal(size=(num_experts, hidden, hidden)), jnp.float32)
    x = rng.normal(size=(num_ranks, num_tokens, hidden)).astype(np.float32)
    experts = np.stack(
        [
            [rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)]
            for _ in range(num_ranks)
        ]
    ).astype(np.int32)
    experts[1] = experts[1, :1]  # the idle rank's padding routes alike
    weights = rng.uniform(size=(num_ranks, num_tokens, top_k)).astype(np.float32)

    def device(x, weights, experts):
        first = (jax.lax.axis_index(DP_AXIS) * num_shards + jax.lax.axis_index(TP_AXIS)) * num_local
        run = lambda x, weights, experts: _experts(x, weights, experts, w, first, num_local)
        return dispatch_over_ranks(run, x, weights, experts, num_ranks, num_local, "float32")

    # [R, T] devices, each rank's inputs on its T columns alike.
    columns = jax.vmap(device, in_axes=None, axis_size=num_shards, axis_name=TP_AXIS)
    out = jax.jit(jax.vmap(columns, axis_name=DP_AXIS))(x, weights, experts)  # [R, T, t, D]
    expected = jax.vmap(lambda *a: _experts(*a, w, 0, num_experts))(x, weights, experts)
    np.testing.assert_allclose(out.sum(axis=1), expected, rtol=1e-5, atol=1e-5)
