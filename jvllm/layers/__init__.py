"""The shared layers the model families are built from (attention, MLP, MoE, norms, rotary, linear), as flax.nnx modules."""
