"""jax.lax.ragged_all_to_all, with the same semantics on XLA:CPU, which does not implement the
op ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"; jax#34755).

On a CPU each slice travels in a block of `max_send_size` rows, a dense `jax.lax.all_to_all`
of [N, max_send_size, ...] (N slices), and the receiver scatters each block's first recv_size
rows into `output` at the offsets the senders asked for (an all_to_all of output_offsets,
which is how the op defines them). It moves as many bytes as an all-gather of the operand's
capacity, so it only stands in for the op: it runs the same exchange, so that the CPU tests
check the code around it. Elsewhere the native op runs; jax lowers it to XLA's
ragged-all-to-all, which no test here has run (the machines jvllm is tested on have one GPU at
most): the emulation is pinned to the op's documented semantics (tests/test_ragged_all_to_all.py),
not to the op itself.
"""

import functools

import jax
import jax.numpy as jnp


def ragged_all_to_all(*args: jax.Array, axis_name: str, max_send_size: int) -> jax.Array:
    """jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
    recv_sizes, axis_name=axis_name), its six arrays `args`: slice j of operand [M, ...]
    (input_offsets[j], send_sizes[j] rows; N slices i32[N], N a multiple of the axis size, N /
    size to each peer in order) is written on its peer at output_offsets[j] (an offset in the
    peer's output), and what the peers send lands in output [R, ...], recv_sizes[j] rows from
    slice j's sender; the rest of output stays as given. max_send_size: a static bound on every
    slice's size, the block a slice travels in on a CPU (dense_ragged_all_to_all); the native
    op ignores it."""
    dense = functools.partial(
        dense_ragged_all_to_all, axis_name=axis_name, max_send_size=max_send_size
    )
    native = functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name)
    # The branch is picked when the step is lowered for its platform: XLA:CPU never sees the
    # native op, and a GPU never the blocks.
    return jax.lax.platform_dependent(*args, cpu=dense, default=native)


def dense_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
    max_send_size: int,
) -> jax.Array:
    """ragged_all_to_all as a dense all-to-all of [N, max_send_size, ...] blocks, each slice's
    rows first, then a scatter of each received block's recv_sizes rows into output.
    send_sizes is not read: a block's rows past it are never written (recv_sizes, which the op
    requires to equal the sender's send_sizes, bounds the scatter)."""
    del send_sizes
    rows = jnp.arange(max_send_size)
    # [N, C]: slice j's rows in operand; past its end, rows the receiver does not write.
    picks = jnp.clip(input_offsets[:, None] + rows, 0, operand.shape[0] - 1)
    # Slice j of each sender goes to peer j // (N / size); peer p's blocks arrive in order.
    blocks = jax.lax.all_to_all(operand[picks], axis_name, 0, 0, tiled=True)  # [N, C, ...]
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [N]
    targets = jnp.where(rows < recv_sizes[:, None], offsets[:, None] + rows, output.shape[0])
    received = blocks.reshape(-1, *operand.shape[1:])  # [N C, ...]
    return output.at[targets.reshape(-1)].set(received, mode="drop")
