"""layers/ragged_all_to_all.py on a CPU, where XLA has no ragged-all-to-all: the dense blocks
that stand in for it give, on random sizes and offsets over 2 and 4 peers (a named vmap axis,
which jax's all_to_all runs as it runs over devices), what jax documents the op to give. So
the native op, which runs on a GPU and no test here has run, makes the same exchange."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jvllm.layers.ragged_all_to_all import dense_ragged_all_to_all, ragged_all_to_all


def _documented(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """jax.lax.ragged_all_to_all's docstring, as a loop over every peer: slice j of peer p
    goes to peer j // (N / n), which writes it at p's output_offsets[j], recv_sizes rows."""
    num_peers, num_slices = input_offsets.shape
    per_peer = num_slices // num_peers
    results = outputs.copy()
    for src in range(num_peers):
        for j in range(num_slices):
            dst, q = divmod(j, per_peer)
            size = recv_sizes[dst, src * per_peer + q]
            assert size == send_sizes[src, j]  # the op's requirement
            start, at = input_offsets[src, j], output_offsets[src, j]
            results[dst, at : at + size] = operands[src, start : start + size]
    return results


def _random_exchange(rng, num_peers: int, per_peer: int, capacity: int):
    """Each peer's operand with its slices at random offsets (some overlapping, some empty),
    and each receiver's slots placed in a random order with gaps between them."""
    num_slices = num_peers * per_peer
    send_sizes = rng.integers(0, capacity + 1, (num_peers, num_slices))
    operand_rows = 2 * capacity
    input_offsets = rng.integers(0, operand_rows - capacity + 1, (num_peers, num_slices))
    operands = rng.normal(size=(num_peers, operand_rows, 3)).astype(np.float32)
    output_rows = num_slices * (capacity + 2)
    output_offsets = np.zeros_like(send_sizes)
    recv_sizes = np.zeros_like(send_sizes)
    for dst in range(num_peers):
        at = 0
        for i in rng.permutation(num_slices):  # i = src * per_peer + q arrives at dst
            src, q = divmod(i, per_peer)
            size = send_sizes[src, dst * per_peer + q]
            at += rng.integers(0, 3)
            output_offsets[src, dst * per_peer + q] = at
            recv_sizes[dst, i] = size
            at += size
    outputs = np.full((num_peers, output_rows, 3), -1.0, np.float32)
    args = (operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes)
    return tuple(a.astype(np.int32) if a.dtype == np.int64 else a for a in args)


def _blocks(max_send_size: int):
    """The CPU's stand-in over a named vmap axis of peers, jitted."""
    exchange = functools.partial(
        dense_ragged_all_to_all, axis_name="peers", max_send_size=max_send_size
    )
    return jax.jit(jax.vmap(exchange, axis_name="peers"))


@pytest.mark.parametrize(("num_peers", "per_peer"), [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_blocks_make_the_exchange_the_op_documents(num_peers, per_peer):
    rng = np.random.default_rng(num_peers * 10 + per_peer)
    capacity = 5
    exchange = _blocks(capacity)
    for _ in range(3):
        args = _random_exchange(rng, num_peers, per_peer, capacity)
        np.testing.assert_array_equal(np.asarray(exchange(*args)), _documented(*args))


def test_the_docstring_example():
    """jax's own example over 2 peers."""
    args = (
        np.array([[1, 2, 2], [3, 4, 0]], np.float32),
        np.zeros((2, 4), np.float32),
        np.array([[0, 1], [0, 1]], np.int32),
        np.array([[1, 2], [1, 1]], np.int32),
        np.array([[0, 0], [1, 2]], np.int32),
        np.array([[1, 1], [2, 1]], np.int32),
    )
    np.testing.assert_array_equal(_blocks(2)(*args), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_a_cpu_runs_the_blocks_in_place_of_the_op():
    """The platform switch, jitted over a mesh of the one CPU device (a vmap would trace the
    native op's branch too, which has no batching rule): XLA:CPU, which lacks the op, runs."""
    mesh = jax.make_mesh((1,), ("peers",))
    exchange = functools.partial(ragged_all_to_all, axis_name="peers", max_send_size=2)
    # check_vma off, as distributed/data_parallel_moe.py's shard_map runs the model.
    mapped = jax.shard_map(exchange, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    run = jax.jit(mapped)
    args = (
        np.array([1, 2, 3], np.float32),
        np.zeros(4, np.float32),
        np.array([1], np.int32),
        np.array([2], np.int32),
        np.array([1], np.int32),
        np.array([2], np.int32),
    )
    np.testing.assert_array_equal(run(*args), [0, 2, 3, 0])
