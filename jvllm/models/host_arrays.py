"""Host arrays that XLA:CPU takes in place: a checkpoint's params are built in buffers aligned
as XLA:CPU needs, so that jax.device_put on CPU uses them rather than copying them."""

from __future__ import annotations

from typing import Any

import numpy as np

_XLA_CPU_ALIGNMENT = 64  # what a host buffer needs for XLA:CPU to use it in place


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.empty aligned for XLA:CPU: jax.device_put of such an array on CPU uses its buffer in
    place, where an unaligned one (NumPy's big arrays start 16 bytes past a page) is copied, at
    a fraction of NumPy's copy speed (BENCHMARKS.md, "Model loading")."""
    dtype = np.dtype(dtype)
    num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(num_bytes + _XLA_CPU_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _XLA_CPU_ALIGNMENT
    return raw[start : start + num_bytes].view(dtype).reshape(shape)


def aligned_copy(x: np.ndarray, dtype: Any = None) -> np.ndarray:
    """x copied into an aligned_empty array (of `dtype`, else x's)."""
    out = aligned_empty(x.shape, x.dtype if dtype is None else dtype)
    out[...] = x
    return out
