"""Per-expert token counts: each MoE layer's (token, expert) assignments of a step's tokens that
the engine keeps, counted on the device and returned from the forward beside the hidden states
(vLLM's expert load statistics, what an expert placement is balanced by).

A family counts where it routes (`count_experts`, experts i32[T, k] -> one row i32[E]); the
layer scan hands each layer's row out of its body as a scan output (`counted_layer`, stacked
[L, E]); the forward collects the stacks of its scans in layer order (`counting_experts`).
All three meet through a context set while the forward is traced, as LoRA's token slots do
(layers/lora.py), so no family passes counts layer to layer, and a forward traced without the
context (or a model without experts) compiles as before: no count, no scan output.

Under expert parallelism every device routes every token with the whole router, so each
device's counts are already the global ones (distributed/expert_parallel.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class _Counting:
    is_counted: jax.Array  # bool[T]: the tokens the engine keeps
    stacks: list[jax.Array] = dataclasses.field(default_factory=list)  # i32[L_i, E] each
    layer: jax.Array | None = None  # i32[E]: the row of the layer being traced


_COUNTING: contextvars.ContextVar[_Counting | None] = contextvars.ContextVar(
    "expert_counting", default=None
)


@contextlib.contextmanager
def counting_experts(is_counted: jax.Array) -> Iterator[_Counting]:
    """While tracing a forward: count the routed experts of the tokens `is_counted` bool[T];
    `expert_counts` of the yielded value reads them once the forward is traced."""
    counting = _Counting(is_counted)
    previous = _COUNTING.set(counting)
    try:
        yield counting
    finally:
        _COUNTING.reset(previous)


def expert_counts(counting: _Counting) -> jax.Array | None:
    """The counts the forward's scans collected -> i32[L_moe, E], its MoE layers in order; None
    where no layer counted (a model without routed experts)."""
    if not counting.stacks:
        return None
    return jnp.concatenate(counting.stacks)


def count_experts(experts: jax.Array, num_experts: int) -> None:
    """The layer being traced routed its tokens to experts i32[T, k] (the router's ids, of
    `num_experts`): count each counted token's k assignments, the others not at all. Nothing
    outside `counting_experts`."""
    counting = _COUNTING.get()
    if counting is None:
        return
    # The uncounted tokens' assignments go to id E, which bincount drops.
    ids = jnp.where(counting.is_counted[:, None], experts, num_experts).reshape(-1)  # [T*k]
    counting.layer = jnp.bincount(ids, length=num_experts).astype(jnp.int32)  # [E]


def counted_layer(trace_layer: Callable[[], Any]) -> tuple[Any, jax.Array | None]:
    """Trace one layer (`trace_layer()`, in a scan body) -> (its result, the row i32[E] it
    counted: None where it routes nothing, or nothing counts)."""
    counting = _COUNTING.get()
    if counting is None:
        return trace_layer(), None
    outer, counting.layer = counting.layer, None
    try:
        return trace_layer(), counting.layer
    finally:
        counting.layer = outer


def add_stack(rows: jax.Array | None) -> None:
    """A scan's rows i32[L, E] (None: its layers counted nothing), after the stacks before."""
    counting = _COUNTING.get()
    if counting is not None and rows is not None:
        counting.stacks.append(rows)
