"""The matmul under the dense layers: x @ w.T in the weight's dtype, accumulated in float32."""

import jax
import jax.numpy as jnp

from jvllm.quantization import cpu_dense


def dot_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] @ w [O, I].T -> float32 [..., O], with x cast to w's dtype.

    On CPU a few rows (up to cpu_dense.STREAM_ROWS) of a bfloat16 or float32 weight go through
    the native kernel (cpu_dense.py). Without it, a single row of a 16-bit weight goes in as two
    equal rows and the second product is dropped: XLA:CPU runs a 1-row bfloat16 dot by
    converting the whole weight to float32 first, and sends two rows to its matmul library,
    which reads the weight once (SmolLM2 bfloat16 batch-1 decode: 23.5 -> 32.8 tok/s against a
    multiply + reduce; BENCHMARKS.md). A float32 weight's 1-row dot is the faster one (23.5
    against 18.9 tok/s).
    """
    rows = x.reshape(-1, x.shape[-1]).astype(w.dtype)  # [R, I]
    num_rows, num_in = rows.shape
    if cpu_dense.supports(w.dtype, num_in, num_rows):
        return dot_layer(x, w[None], 0)
    contract = (((1,), (1,)), ((), ()))
    one_row = num_rows == 1 and w.dtype.itemsize == 2 and jax.default_backend() == "cpu"
    if one_row:
        rows = jnp.broadcast_to(rows, (2, num_in))
    y = jax.lax.dot_general(rows, w, contract, preferred_element_type=jnp.float32)  # [R, O]
    return y[:1].reshape(*x.shape[:-1], -1) if one_row else y.reshape(*x.shape[:-1], -1)


def dot_layer(x: jax.Array, stack: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x [..., I] @ stack[layer].T -> float32 [..., O] for a weight stacked [L, O, I] and a
    layer i32[]: the CPU kernel reads the layer where it lies (inside the layer scan XLA:CPU
    would copy it out first), up to its row limit; elsewhere the layer is sliced for dot_rows."""
    num_rows = x.size // x.shape[-1]
    if cpu_dense.supports(stack.dtype, x.shape[-1], num_rows, in_place=True):
        rows = x.reshape(num_rows, -1).astype(stack.dtype)  # [R, I]
        return cpu_dense.dense(rows, stack, layer).reshape(*x.shape[:-1], -1)
    return dot_rows(x, jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False))
