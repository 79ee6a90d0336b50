"""The safetensors format (header: u64 length + JSON; then the tensors' bytes), read and written
with NumPy alone.

jnp.bfloat16 is ml_dtypes' NumPy type, which the safetensors NumPy API lacks; and writing through
that API makes a bytes copy of every tensor. The format is simple enough to do both here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

# safetensors dtype tags -> NumPy dtypes.
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": jnp.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,  # int8 weights and zero points (compressed-tensors)
    "U8": np.uint8,  # packed quantized weights (MXFP4's blocks and scales)
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # FP8 checkpoints' weights
    "BOOL": np.bool_,  # an EAGLE-3 head's t2d (the draft vocabulary's members)
}
_ALIGNMENT = 64  # where the data starts in a file we write: aligned for whoever maps it


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-map every tensor of one .safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        tensors[name] = data[start:end].view(dtype).reshape(info["shape"])
    return tensors


def write_float32_safetensors(
    path: str,
    shapes: Mapping[str, tuple[int, ...]],
    fill: Callable[[str, np.ndarray], object],
) -> None:
    """Write one float32 tensor per name of `shapes`, in that order; `fill(name, out)` writes the
    tensor's values into `out` (f32[shape], a buffer reused from tensor to tensor), so the only
    full copy of the weights is the file."""
    sizes = {name: int(np.prod(shape, dtype=np.int64)) for name, shape in shapes.items()}
    header, offset = {}, 0
    for name, shape in shapes.items():
        end = offset + 4 * sizes[name]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = {"format": "pt"}  # what HF transformers expects of a checkpoint
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-(8 + len(header_bytes)) % _ALIGNMENT)  # the format's padding
    buffer = np.empty(max(sizes.values(), default=0), np.float32)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for name, shape in shapes.items():
            out = buffer[: sizes[name]].reshape(shape)
            fill(name, out)
            f.write(memoryview(out).cast("B"))
