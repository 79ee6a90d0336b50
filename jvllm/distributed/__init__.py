"""Scale-out over a JAX device mesh: the mesh, tensor-parallel layout and placement, the
sharded model step, data-parallel replicas, and several hosts through jax.distributed."""
