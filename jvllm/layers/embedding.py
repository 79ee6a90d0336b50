"""Token embedding, and the LM head that reuses it when the model ties the two."""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.layers.linear import dense
from jvllm.layers.params import param


class Embed(nnx.Module):
    """embedding [V, D] in the model dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype):
        self.embedding = param((vocab_size, hidden_size), dtype, ("vocab", "embed"))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """token_ids i32[T] -> float32 [T, D]. XLA:CPU cannot gather bfloat16 natively (it
        converts the whole table to float32 and back each call), so a bfloat16 table is
        gathered as uint16."""
        table = self.embedding[...]
        if table.dtype != jnp.bfloat16:
            return table[token_ids].astype(jnp.float32)
        bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[token_ids]
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """The tied LM head: hidden [S, D] -> float32 logits [S, V]."""
        return dense(hidden, self.embedding[...])
