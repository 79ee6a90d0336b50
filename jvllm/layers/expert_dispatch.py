"""Across data-parallel ranks (distributed/data_parallel_moe.py), a MoE layer's tokens sent to
the devices of their experts and the experts' outputs sent back (DeepEP's dispatch and
combine; vLLM's all2all backends), by ragged all-to-alls over "data": all2all_backend
"ragged_all_to_all". The other form, layers/parallel.py's all-gather and reduce-scatter, brings
every rank's tokens to every device; docs/design.md ("MoE layers across data-parallel ranks")
says which moves fewer bytes where, and distributed/data_parallel_moe.py picks one.

Device (d, i) of the (data, model) mesh holds the experts of flat device d T + i
(first_local_expert). The rank's T devices hold the same tokens; device (d, i) handles those of
their assignments whose expert lies in column i, sending each token once to each row that
holds any of its column-i experts (DeepEP's rule: a token with two experts on one device
travels once), with its weights and expert ids masked to that row's experts (id -1, weight 0
elsewhere, which group_by_expert drops). The rows' partial sums come back to the token's slots
and are summed per token; the layer's all-reduce over "model" sums the columns, as for the
gather. So every exchange runs over "data", within a column.

Glossary: T a rank's tokens, k experts a token, D hidden, R ranks (the "data" axis), S the
send slots, min(k, R) T: a token goes to at most k rows, and to each at most once.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jvllm.layers.params import DP_AXIS, TP_AXIS
from jvllm.layers.ragged_all_to_all import ragged_all_to_all


class DispatchLayout(NamedTuple):
    """Where a rank's tokens go: send slot s holds token slot_tokens[s] for one row, the slots
    grouped by row in row order (row r's input_offsets[r] .. + send_sizes[r]), each row's
    tokens in token order; slots past the last row's hold nothing that is sent."""

    slot_tokens: jax.Array  # i32[S]
    slot_routes: jax.Array  # bool[S, k]: the token's assignments whose expert the row holds
    send_sizes: jax.Array  # i32[R]: the tokens row r gets
    input_offsets: jax.Array  # i32[R]: row r's first slot


def dispatch_layout(
    experts: jax.Array, num_local_experts: int, num_ranks: int, num_shards: int, column
) -> DispatchLayout:
    """experts i32[T, k] (the router's ids), E / (R num_shards) experts a device, -> the
    layout of this device's sends: to each row, the tokens with an expert on that row's device
    in `column` (an int or i32[], the device's index on "model"), each once."""
    num_tokens, top_k = experts.shape
    device = experts // num_local_experts  # [T, k]: the flat device d T + i holding each
    # Each assignment's row, or R where another column's device holds its expert.
    row = jnp.where(device % num_shards == column, device // num_shards, num_ranks)
    routes = row[None] == jnp.arange(num_ranks)[:, None, None]  # [R, T, k]
    is_sent = routes.any(axis=-1)  # [R, T]
    send_sizes = is_sent.sum(axis=1, dtype=jnp.int32)
    # The sent (row, token) pairs first, row by row, each row's tokens in order.
    order = jnp.argsort(~is_sent.reshape(-1), stable=True)[: min(top_k, num_ranks) * num_tokens]
    slot_rows, slot_tokens = order // num_tokens, order % num_tokens
    return DispatchLayout(
        slot_tokens.astype(jnp.int32),
        routes[slot_rows, slot_tokens],
        send_sizes,
        jnp.cumsum(send_sizes, dtype=jnp.int32) - send_sizes,
    )


def dispatch_over_ranks(
    run: Callable[..., jax.Array],
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    num_ranks: int,
    num_local_experts: int,
    rows_dtype: str,
) -> jax.Array:
    """layers/parallel.py's experts_over_ranks by ragged all-to-alls: run(x f32[R T, D],
    weights f32[R T, k], experts i32[R T, k]) -> this device's experts' partial sums
    f32[R T, D], called here on what the `num_ranks` ranks sent this device (rank p's tokens
    in block p of R T rows, the block's unfilled rows id -1 and weight 0) -> the partial sums
    of this rank's T tokens f32[T, D]. The tokens travel in `rows_dtype`, the partial sums
    come back in float32."""
    num_tokens = x.shape[0]
    rank, column = jax.lax.axis_index(DP_AXIS), jax.lax.axis_index(TP_AXIS)
    layout = dispatch_layout(
        experts, num_local_experts, num_ranks, jax.lax.axis_size(TP_AXIS), column
    )
    # Each peer's (size, first slot) of what it sends this device: [R, 2].
    sent = jnp.stack([layout.send_sizes, layout.input_offsets], axis=1)
    recv_sizes, peer_offsets = jax.lax.all_to_all(sent, DP_AXIS, 0, 0, tiled=True).T
    # A slice is at most T rows: a token goes to a row once.
    exchange = functools.partial(ragged_all_to_all, axis_name=DP_AXIS, max_send_size=num_tokens)
    # This rank's tokens land in block `rank` of each peer's R T rows.
    block = jnp.full((num_ranks,), rank * num_tokens, jnp.int32)

    def send(a: jax.Array, fill) -> jax.Array:
        received = jnp.full((num_ranks * num_tokens, *a.shape[1:]), fill, a.dtype)
        return exchange(a, received, layout.input_offsets, layout.send_sizes, block, recv_sizes)

    tokens, routes = layout.slot_tokens, layout.slot_routes
    out = run(
        send(x.astype(rows_dtype)[tokens], 0),
        send(jnp.where(routes, weights[tokens], 0.0), 0),
        send(jnp.where(routes, experts[tokens], -1), -1),
    )  # f32[R T, D]
    # Block p back to rank p's slots; the slots nothing went to stay 0.
    returned = exchange(
        out,
        jnp.zeros((tokens.size, out.shape[1]), out.dtype),
        jnp.arange(num_ranks, dtype=jnp.int32) * num_tokens,
        recv_sizes,
        peer_offsets,
        layout.send_sizes,
    )  # f32[S, D]
    return jax.ops.segment_sum(returned, tokens, num_segments=num_tokens)
