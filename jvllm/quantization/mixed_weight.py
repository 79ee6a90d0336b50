"""A layer weight whose GGUF block formats differ from layer to layer or between its fused pieces.

llama.cpp's mixed quantizations do this: Q4_K_M keeps most layers' attn_v and ffn_down in Q6_K
and the rest in Q4_K, so a fused q|k|v weight holds two formats in one layer and a stacked
ffn_down two across its layers. Blocks of different formats cannot share arrays, so a
`MixedGGUFWeight` holds, for each run of output rows whose layers agree on their formats (a
piece: q|k and v above), one stacked `GGUFWeight` per format over the layers of that format.
At a layer of the scan each piece runs its format's weight at the layer's index among that
format's layers (a `lax.switch` over the formats), and the pieces' outputs are concatenated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.quantization.packed_weight import GGUFWeight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixedGGUFWeight:
    """pieces[p][g]: piece p's rows (in output order) for the layers `members[p][g]` (ascending),
    a GGUFWeight stacked [len(members[p][g]), O_p, I] of one format; layer: None, or i32[]
    where the scan hands the weight its layer. One layer's weight (the layers split on a GPU,
    layers/scan.py) has members None and one unstacked GGUFWeight a piece."""

    pieces: tuple[tuple[GGUFWeight, ...], ...]
    members: tuple[tuple[tuple[int, ...], ...], ...] | None = dataclasses.field(
        metadata={"static": True}
    )
    layer: jax.Array | None = None

    @property
    def num_layers(self) -> int | None:
        if self.members is None:
            return None
        return sum(len(layers) for layers in self.members[0])

    @property
    def qtypes(self) -> set[int]:
        return {w.qtype for groups in self.pieces for w in groups}

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [(L,) O, I]."""
        rows = sum(groups[0].shape[-2] for groups in self.pieces)
        lead = (self.num_layers,) if self.members is not None and self.layer is None else ()
        return (*lead, rows, self.pieces[0][0].shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for groups in self.pieces for w in groups)

    def at_layer(self, layer: jax.Array) -> MixedGGUFWeight:
        return dataclasses.replace(self, layer=layer)

    def __getitem__(self, key):
        """`param[...]` (how the layers read a weight) gives the weight itself."""
        if key is not Ellipsis:
            raise TypeError("a GGUF weight is read whole (weight[...]); use dense()")
        return self

    def layer_weights(self) -> list[MixedGGUFWeight]:
        """Each layer's own weight (members None), its pieces' blocks sliced out."""
        weights = []
        for layer in range(self.num_layers):
            pieces = []
            for groups, members in zip(self.pieces, self.members, strict=True):
                g = next(g for g, layers in enumerate(members) if layer in layers)
                index = members[g].index(layer)
                fields = {k: v[index] for k, v in groups[g].fields.items()}
                pieces.append((dataclasses.replace(groups[g], fields=fields),))
            weights.append(MixedGGUFWeight(tuple(pieces), None))
        return weights

    def dense(self, x: jax.Array) -> jax.Array:
        """x [..., I] @ weight [O, I].T -> f32[..., O] (GGUFWeight.dense, piece by piece)."""
        return self._by_piece(lambda w: w.dense(x), axis=-1)

    def dequantize(self) -> jax.Array:
        """-> f32[(L,) O, I]: the values gguf.quants.dequantize gives."""
        if self.members is not None and self.layer is None:
            return jnp.stack(
                [self.at_layer(jnp.int32(i)).dequantize() for i in range(self.num_layers)]
            )
        return self._by_piece(lambda w: w.dequantize(), axis=-2)

    def _by_piece(self, fn: Callable[[GGUFWeight], jax.Array], axis: int) -> jax.Array:
        """fn of each piece's weight at this layer, concatenated along `axis`."""
        outputs = []
        for p, groups in enumerate(self.pieces):
            if self.members is None:
                outputs.append(fn(groups[0]))
                continue
            group_of, index_of = _layer_maps(self.members[p])
            index = jnp.asarray(index_of)[self.layer]
            branches = [lambda w=w, i=index: fn(w.at_layer(i)) for w in groups]
            if len(branches) == 1:
                outputs.append(branches[0]())
            else:
                outputs.append(jax.lax.switch(jnp.asarray(group_of)[self.layer], branches))
        return jnp.concatenate(outputs, axis=axis)


def _layer_maps(members: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """For each layer, the group holding it and its index there -> (i32[L], i32[L])."""
    num_layers = sum(len(layers) for layers in members)
    group_of = np.zeros(num_layers, np.int32)
    index_of = np.zeros(num_layers, np.int32)
    for g, layers in enumerate(members):
        group_of[list(layers)] = g
        index_of[list(layers)] = np.arange(len(layers))
    return group_of, index_of
