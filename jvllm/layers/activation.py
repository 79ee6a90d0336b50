"""MLP activations by their HF `hidden_act` names, computed in float32."""

import functools

import jax

from jvllm.config import SUPPORTED_ACTIVATIONS

# One for each of SUPPORTED_ACTIVATIONS, in its order (config.py, below the layers, lists the
# names without importing JAX).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    # GeLU's tanh approximation, under the names Gemma, GPT-2 and GPT-NeoX-20B give it.
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
}


def check_activation(name: str, field: str) -> str:
    """`name` when it is one of SUPPORTED_ACTIVATIONS, else a ValueError that names the config's `field`."""
    if name not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; allowed: {SUPPORTED_ACTIVATIONS}")
    return name
