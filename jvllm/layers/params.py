"""Creating a module's weights with logical axis names.

Every weight names its axes with the names below (MaxText's logical axes); the scale-out work
maps names to mesh axes in one table, so sharding a model is configuration, not a rewrite.
Modules are only ever built under `nnx.eval_shape` (models/model.py): the values here are never
computed, the loaders fill them in.
"""

from typing import Any

import jax.numpy as jnp
from flax import nnx

# "layers" is the stacked layer axis the layer scan walks (added by layers/scan.py).
# "positions" is a learned position table's row axis (GPT-2, OPT).
# "lora" is the adapter slots' columns of a projection (layers/lora.py).
AXIS_NAMES = (
    "layers",
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "experts",
    "positions",
    "lora",
)
# The device mesh's axes (distributed/mesh.py): data-parallel replicas, and the tensor-parallel
# group that the names above are cut over (distributed/tensor_parallel.py's AXIS_RULES). Here,
# beside the names, so that the layers that sum or gather over a mesh axis import no
# distributed code.
DP_AXIS = "data"
TP_AXIS = "model"


# A fused axis's pieces, in order, as (count, unit) each: q|k|v is ((N, H), (K, H), (K, H)),
# gate|up ((F, 1), (F, 1)). Tensor parallelism cuts each piece into its shards and lays the
# axis out shard-major (distributed/tensor_parallel.py), so that every device's slice holds its
# own share of each piece.
Segments = tuple[tuple[int, int], ...]


def param(
    shape: tuple[int, ...], dtype: Any, axes: tuple[str, ...], segments: Segments | None = None
) -> nnx.Param:
    """A weight of `shape` whose axes are named `axes` (one of AXIS_NAMES each); `segments`
    describes its fused axis (the one named "heads" or "mlp") when it concatenates pieces."""
    if len(axes) != len(shape) or not set(axes) <= set(AXIS_NAMES):
        raise ValueError(f"axes {axes} must name each of the {len(shape)} axes from {AXIS_NAMES}")
    # eager_sharding=False: the names describe the axes; they shard nothing until a mesh is
    # configured.
    return nnx.Param(
        jnp.zeros(shape, dtype), out_sharding=axes, eager_sharding=False, segments=segments
    )
