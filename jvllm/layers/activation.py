"""MLP activations by their HF `hidden_act` names, computed in float32."""

import functools

import jax
import jax.numpy as jnp

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
    # HF's other names (its ACT2FN) of these, and the rest of its activations a config may name.
    "swish": jax.nn.silu,
    "gelu_python": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_python_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_accurate": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_10": lambda x: jnp.clip(jax.nn.gelu(x, approximate=False), -10.0, 10.0),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "mish": jax.nn.mish,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
}


def check_activation(name: str, field: str) -> str:
    """`name` when it is one of SUPPORTED_ACTIVATIONS, else a ValueError that names the config's `field`."""
    if name not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; allowed: {SUPPORTED_ACTIVATIONS}")
    return name
