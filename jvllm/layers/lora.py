"""LoRA adapters inside a projection: y = W x + sum over the token's adapter of B (A x).

A projection that takes adapters holds, beside its weight W [O, I], S adapter slots side by
side: A [S*W', I] and B [O, S*W'], slot s in rows (columns of B) s*W' .. (s+1)*W', its
scaling already folded into B (jvllm/lora/). W' = P*R: a fused projection (q|k|v, gate|up)
gives each of its P checkpoint modules R columns of its own (B block-diagonal over the
pieces), R being max_lora_rank; an adapter of smaller rank is zero-padded. A slot holding no
adapter is all zeros.

Each token says which slot it reads (`adapter_tokens`, i32[T], -1 for none): the step computes
x @ A.T for every slot at once (S*W' columns, a thin matmul), zeroes the columns of the slots
the token does not read, and multiplies by B.T. One batch mixes adapters and the base model,
with no gather of per-token weights. The token slots reach the projections as a context set
around the model's forward (models/model.py), so that no family passes them layer to layer.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig

_TOKEN_SLOTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "lora_token_slots", default=None
)


@contextlib.contextmanager
def adapter_tokens(token_slots: jax.Array | None):
    """While tracing the forward: each token's adapter slot i32[T] (-1: none); None: no
    adapters in this step, and the projections compute no LoRA terms."""
    previous = _TOKEN_SLOTS.set(token_slots)
    try:
        yield
    finally:
        _TOKEN_SLOTS.reset(previous)


def lora_shape(config: ModelConfig, num_pieces: int = 1) -> tuple[int, int] | None:
    """(S slots, W' columns a slot) of a projection fused of `num_pieces` checkpoint modules;
    None where the model takes no adapters (`max_loras` 0)."""
    if not config.max_loras:
        return None
    return config.max_loras, num_pieces * config.max_lora_rank


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, num_slots: int, dense) -> jax.Array | None:
    """x [T, I] -> f32[T, O]: each token's adapter term (`dense`: layers/linear.py's matmul);
    None outside a step with adapters."""
    token_slots = _TOKEN_SLOTS.get()
    if token_slots is None:
        return None
    if x.shape[0] != token_slots.shape[0]:
        raise ValueError(f"LoRA needs one slot per token: x {x.shape}, slots {token_slots.shape}")
    xa = dense(x, a)  # [T, S*W']
    width = xa.shape[-1] // num_slots
    slot_of_column = jnp.arange(num_slots * width) // width  # [S*W']
    keep = token_slots[:, None] == slot_of_column[None, :]  # [T, S*W']
    return dense(jnp.where(keep, xa, 0.0), b)  # [T, O]
