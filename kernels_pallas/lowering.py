"""Lower a kernel for CUDA on a machine without a GPU, through an abstract H100.

Tracing and lowering run the whole Pallas -> Triton IR path, so this catches what the Triton
lowering rejects (non power-of-two blocks, unsupported ops or indexing) at production shapes.
It does not run Triton's own compiler (jaxlib <= 0.10.2 defers that to XLA at compile time), so
register or shared-memory overflow and Triton-side checks such as dot dims >= 16 are not caught.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)

# jaxlib <= 0.10.2 emits the Triton IR in this custom call; later versions compile it in process
# and emit "triton_kernel_call_ffi".
_TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def lower_for_cuda(
    fn: Callable[..., Any], *args: Any, device: AbstractDevice = H100
) -> jax.stages.Lowered:
    """Traces `fn(*args)` under jit for `device` and lowers it for CUDA.

    `args` may be arrays or `jax.ShapeDtypeStruct`s; non-array arguments belong in `fn`'s closure.
    """
    mesh = AbstractMesh((), (), abstract_device=device)
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def num_triton_calls(lowered: jax.stages.Lowered) -> int:
    """How many Triton kernels the lowered StableHLO launches."""
    text = lowered.as_text()
    return sum(text.count(f"@{target}(") for target in _TRITON_CALL_TARGETS)
