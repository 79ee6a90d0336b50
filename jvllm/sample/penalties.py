"""vLLM's repetition, frequency and presence penalties on device.

The token history comes from the engine's paged token cache (`token_cache: i32[P, B]`, written
at the same slots as the KV cache), so a request's counts need no per-step host arrays and stay
right under prefix caching, preemption and parallel sampling.
"""

import jax
import jax.numpy as jnp


def token_counts(
    token_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    num_prompt_tokens: jax.Array,
    vocab_size: int,
) -> tuple[jax.Array, jax.Array]:
    """(f32[S, V] output token counts, bool[S, V] prompt token mask) of each sequence's KV span."""
    num_seqs, max_pages = block_tables.shape
    block_size = token_cache.shape[1]
    history = token_cache[block_tables].reshape(num_seqs, max_pages * block_size)  # [S, M*B]
    positions = jnp.arange(max_pages * block_size)[None]
    valid = positions < seq_lens[:, None]
    is_output = valid & (positions >= num_prompt_tokens[:, None])
    is_prompt = valid & ~is_output
    rows = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], history.shape)
    zeros = jnp.zeros((num_seqs, vocab_size), jnp.float32)
    output_counts = zeros.at[rows, history].add(is_output.astype(jnp.float32))
    prompt_counts = zeros.at[rows, history].add(is_prompt.astype(jnp.float32))
    return output_counts, prompt_counts > 0


def apply_penalties(
    logits: jax.Array,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    presence_penalty: jax.Array,
    frequency_penalty: jax.Array,
    repetition_penalty: jax.Array,
) -> jax.Array:
    """f32[S, V] logits with vLLM's penalties: repetition (prompt and output tokens: divide
    positive logits, multiply negative ones), then frequency (per count) and presence (once) over
    output tokens."""
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    rep = jnp.where(seen, repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency_penalty[:, None] * output_counts
    return logits - presence_penalty[:, None] * output_mask
