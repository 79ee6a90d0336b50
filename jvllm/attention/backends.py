"""Choosing the attention implementation: "reference" (pure JAX) or "pallas" (kernels_pallas/)."""

import jax

from jvllm.attention.reference import reference_attention

ATTENTION_BACKENDS = ("reference", "pallas")


def default_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def get_attention(name: str, sm_scale: float):
    """The `attn` callable of the model contract for backend `name`."""
    if name == "reference":
        return reference_attention(sm_scale)
    if name == "pallas":
        from jvllm.attention.pallas import pallas_attention

        return pallas_attention(sm_scale, interpret=jax.default_backend() != "gpu")
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
