"""MLP activations by their HF `hidden_act` names, computed in float32."""

import functools

import jax

ACTIVATIONS = {
    "silu": jax.nn.silu,
    # GeLU's tanh approximation, under the names Gemma and GPT-2 give it.
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
}
