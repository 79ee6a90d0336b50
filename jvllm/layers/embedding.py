"""Token embedding, the LM head that reuses it when the model ties the two, and learned absolute
position embeddings (GPT-2, OPT)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.layers.linear import dense
from jvllm.layers.parallel import sum_over_shards
from jvllm.layers.params import TP_AXIS, param
from jvllm.quantization.packed_weight import GGUFWeight


def _take_rows(table: jax.Array | GGUFWeight, ids: jax.Array) -> jax.Array:
    """table [R, D] rows at ids i32[T] -> float32 [T, D]. XLA:CPU cannot gather bfloat16
    natively (it converts the whole table to float32 and back each call), so a bfloat16 table is
    gathered as uint16. A GGUF table dequantizes only the rows it gives."""
    if isinstance(table, GGUFWeight):
        return table.dequantize(ids).astype(table.dtype).astype(jnp.float32)
    if table.dtype != jnp.bfloat16:
        return table[ids].astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[ids]
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


class Embed(nnx.Module):
    """embedding [V, D] in the model dtype. With `num_shards` > 1 it is one device's slice of
    the vocabulary (rows [i*V, (i+1)*V) on device i): each device looks up the ids it holds and
    the rows are summed over the devices."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, num_shards: int = 1):
        self.embedding = param((vocab_size, hidden_size), dtype, ("vocab", "embed"))
        self.num_shards = num_shards

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """token_ids i32[T] -> float32 [T, D]."""
        table = self.embedding[...]
        if self.num_shards == 1:
            return _take_rows(table, token_ids)
        vocab = table.shape[0]
        local = token_ids - jax.lax.axis_index(TP_AXIS) * vocab  # [T]
        held = (local >= 0) & (local < vocab)
        rows = _take_rows(table, jnp.where(held, local, 0)) * held[:, None]
        return sum_over_shards(rows, self.num_shards)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """The tied LM head: hidden [S, D] -> float32 logits [S, V]."""
        return dense(hidden, self.embedding[...])


class PositionEmbed(nnx.Module):
    """Learned absolute positions: embedding [offset + max_positions, D] in the model dtype, read
    at row `offset + position`. OPT's table starts `offset` 2 rows in (a relic of its padding
    index); GPT-2's at 0."""

    def __init__(self, max_positions: int, hidden_size: int, *, dtype, offset: int = 0):
        self.embedding = param((offset + max_positions, hidden_size), dtype, ("positions", "embed"))
        self.offset = offset

    def __call__(self, positions: jax.Array) -> jax.Array:
        """positions i32[T] -> float32 [T, D]."""
        return _take_rows(self.embedding[...], positions + self.offset)
