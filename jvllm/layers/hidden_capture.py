"""Layers' inputs captured during a forward: the residual stream entering chosen decoder layers,
which an EAGLE-3 draft head reads (speculative decoding, models/eagle3.py).

A family marks where a layer's input is (`capture_layer_input`, in the layer scan's body); the
layer scan threads the captured rows through its carry (layers/scan.py); the forward reads them
once traced (`capturing_layer_inputs`). They meet through a context set while the forward is
traced, as the expert counts do (layers/expert_counts.py), so a forward traced without it
compiles as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Capture:
    layer_ids: tuple[int, ...]  # the decoder layers whose inputs are kept, in this order
    rows: jax.Array  # f32[N, T, D] each one's input, zeros until its layer runs
    is_marked: bool = False  # some layer marked its input: the family's layers expose them


_CAPTURE: contextvars.ContextVar[Capture | None] = contextvars.ContextVar(
    "hidden_capture", default=None
)


@contextlib.contextmanager
def capturing_layer_inputs(
    layer_ids: tuple[int, ...], num_tokens: int, hidden_size: int
) -> Iterator[Capture]:
    """While tracing a forward of `num_tokens` tokens: keep the input f32[T, D] of each decoder
    layer in `layer_ids`; the yielded Capture's `rows` hold them once the forward is traced. A
    ValueError where the forward marked no layer's input (a family whose layers do not run
    through layers/rotary_layers.py)."""
    capture = Capture(layer_ids, jnp.zeros((len(layer_ids), num_tokens, hidden_size)))
    previous = _CAPTURE.set(capture)
    try:
        yield capture
    finally:
        _CAPTURE.reset(previous)
    if not capture.is_marked:
        raise ValueError(
            "the target model's layers do not expose their inputs, which an EAGLE-3 head reads; "
            "the families whose layers run through layers/rotary_layers.py do (Llama, Qwen, "
            "Mistral, Gemma, DeepSeek, gpt-oss, ...)"
        )


def active_capture() -> Capture | None:
    """The capture of the forward being traced (the layer scan threads its rows), or None."""
    return _CAPTURE.get()


def capture_layer_input(layer: jax.Array, x: jax.Array) -> None:
    """Decoder layer `layer` (i32[], the model's index) is about to run on x f32[T, D]: keep x
    where that layer is one captured. Nothing outside `capturing_layer_inputs`."""
    capture = _CAPTURE.get()
    if capture is None:
        return
    capture.is_marked = True
    ids = jnp.asarray(capture.layer_ids, jnp.int32)[:, None, None]  # [N, 1, 1]
    capture.rows = jnp.where(ids == layer, x[None].astype(jnp.float32), capture.rows)
