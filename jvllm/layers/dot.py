"""The matmul under the dense layers: x @ w.T in the weight's dtype, accumulated in float32."""

import jax
import jax.numpy as jnp


def dot_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] @ w [O, I].T -> float32 [..., O], with x cast to w's dtype.

    On CPU a single row of a 16-bit weight goes in as two equal rows and the second product is
    dropped: XLA:CPU runs a 1-row bfloat16 dot by converting the whole weight to float32 first,
    and sends two rows to its matmul library, which reads the weight once (SmolLM2 bfloat16
    batch-1 decode: 23.5 -> 32.8 tok/s against a multiply + reduce; BENCHMARKS.md). A float32
    weight's 1-row dot is the faster one (23.5 against 18.9 tok/s).
    """
    contract = (((1,), (1,)), ((), ()))
    rows = x.reshape(-1, x.shape[-1]).astype(w.dtype)  # [R, I]
    one_row = rows.shape[0] == 1 and w.dtype.itemsize == 2 and jax.default_backend() == "cpu"
    if one_row:
        rows = jnp.broadcast_to(rows, (2, rows.shape[1]))
    y = jax.lax.dot_general(rows, w, contract, preferred_element_type=jnp.float32)  # [R, O]
    return y[:1].reshape(*x.shape[:-1], -1) if one_row else y.reshape(*x.shape[:-1], -1)
