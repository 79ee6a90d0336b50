"""Per-request sampling parameters as arrays, one row per sequence of the step."""

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    seeds: jax.Array  # u32[S] each request's seed
    output_index: jax.Array  # i32[S] how many tokens the request has output so far
    all_greedy: jax.Array  # bool[] every row is greedy: skip the sort and the noise
