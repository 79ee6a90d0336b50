"""Checkpoint tensors -> a model's params dict, each checked against the shape the model declares.

A family's `load_weights` names, for each of its params, the checkpoint tensors it is made of
(models/*.py); this class reads, fuses, casts and stacks them, and says which tensor is wrong
when a checkpoint does not match its config.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jvllm.logger import init_logger
from jvllm.models.host_arrays import aligned_copy, aligned_empty
from jvllm.models.quantized_params import packed_weight, quantized_weight
from jvllm.quantization.host_weights import HostQuantized

logger = init_logger(__name__)


class CheckpointWeights:
    """Fills the params dict declared by `shapes` (a nested dict of ShapeDtypeStructs, as
    models/model.py's param_shapes) from `get(name)` -> the named tensor as NumPy.

    Each param is built in its declared dtype one layer at a time, so the host holds at most
    one param of the model at full precision plus one layer's float32 piece. `place(path, x)`
    puts a finished param on its device(s): by default whole on JAX's default device; under
    tensor parallelism each device gets only its slice (distributed/tensor_parallel.py).

    With `keep_packed`, `get` gives lazy GGUF tensors (model_loader/gguf.py's HFTensor); a param
    whose tensors are all of block formats that stay packed (quantization/gguf_blocks.py)
    becomes a GGUFWeight of their blocks (a MixedGGUFWeight where their formats differ), any
    other is read as floats.

    With `quantized`, a pre-quantized checkpoint's reader (model_loader/quantized_tensors.py):
    `quantized(name)` gives the weight `name` ("...q_proj.weight") in the device layout, or None
    where it is stored as floats. A layer stack's matmul weight (and a MoE's expert stack) whose
    tensors are all quantized alike becomes one IntWeight / FP8Weight kept packed; any other use
    of a quantized tensor (an LM head, a family's transform) reads it dequantized.
    """

    def __init__(
        self,
        get: Callable[[str], np.ndarray],
        shapes: dict,
        num_layers: int,
        layer_prefix: str = "model.layers.{}.",
        place: WholePlacer | None = None,  # or a ParamPlacer, which answers the same calls
        keep_packed: bool = False,
        quantized: Callable[[str], HostQuantized | None] | None = None,
    ):
        self._place = place or WholePlacer()
        self._get = get if not keep_packed else lambda name: _read(get(name))
        self._quantized = quantized
        if quantized is not None:
            self._get = functools.partial(self._dequantized_or_float, get)
        self._dequantized: list[str] = []  # quantized tensors read as floats
        self._get_lazy = get if keep_packed else None
        self._shapes = shapes
        self._num_layers = num_layers
        self._first_layer = 0
        self._stack = "layers"
        self._layer_prefix = layer_prefix
        self._params: dict = {}

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor `name` (for families whose checkpoints name
        their tensors in more than one way)."""
        try:
            self._get(name)
        except (KeyError, ValueError):
            return False
        return True

    def set_layer_prefix(self, layer_prefix: str) -> None:
        """Where layer i's tensors live ("transformer.h.{}."), for a family whose checkpoints
        do not keep them under "model.layers.{}."."""
        self._layer_prefix = layer_prefix

    def set_layers(self, first_layer: int, num_layers: int, stack: str = "layers") -> None:
        """Which checkpoint layers the stacked params read from now on: `num_layers` of them
        from `first_layer`, for a model built of more than one layer stack (dense layers,
        then MoE layers). A stacked param whose path starts with "layers." then goes to the
        stack named `stack` instead, so that a family loads each stack with the same calls."""
        self._first_layer, self._num_layers = first_layer, num_layers
        self._stack = stack

    def tensor(
        self, path: str, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> None:
        """The param at `path` ("embed.embedding") is the tensor `name`, as `transform` makes
        it (e.g. a transpose)."""
        spec = self._spec(path)
        if self._set_packed(path, spec, [[name]], transform, stack=False):
            return
        x = self._get(name)
        x = x if transform is None else transform(x)
        if tuple(x.shape) != tuple(spec.shape):
            raise ValueError(self._mismatch([name], [x.shape], spec.shape, transform))
        self._set(path, self._place(path, aligned_copy(x, spec.dtype)))

    def concatenated(self, path: str, names: list[str]) -> None:
        """The param at `path` is the tensors `names` concatenated along their first axis (an
        unstacked fused projection, e.g. a draft head's q|k|v)."""
        spec = self._spec(path)
        pieces = [self._get(n) for n in names]
        x = np.concatenate(pieces, axis=0)
        if tuple(x.shape) != tuple(spec.shape):
            raise ValueError(self._mismatch(names, [p.shape for p in pieces], spec.shape))
        self._set(path, self._place(path, aligned_copy(x, spec.dtype)))

    def value(self, path: str, x: np.ndarray) -> None:
        """The param at `path` is `x`, which the checkpoint leaves to its default."""
        spec = self._spec(path)
        self._set(path, self._place(path, aligned_copy(np.broadcast_to(x, spec.shape), spec.dtype)))

    def stacked(
        self,
        path: str,
        names: tuple[str, ...],
        transform: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        """The param at `path` [L, ...] is, for each layer i, the layer's tensors `names`
        (after the layer prefix) concatenated along their first axis, each as `transform`
        makes it."""
        path = self._in_stack(path)
        spec = self._spec(path)
        layer_names = [
            [self._layer_prefix.format(i) + n for n in names] for i in self._layer_range()
        ]
        if self._set_packed(path, spec, layer_names, transform, stack=True):
            return
        is_matmul = transform is None and path.endswith(".weight") and len(spec.shape) == 3
        if is_matmul and self._set_quantized(path, spec, layer_names, experts=False):
            return
        out = aligned_empty(spec.shape, spec.dtype)
        for i, full_names in enumerate(layer_names):
            pieces = [self._get(n) for n in full_names]
            pieces = pieces if transform is None else [transform(p) for p in pieces]
            rows = sum(p.shape[0] for p in pieces)
            if any(p.shape[1:] != spec.shape[2:] for p in pieces) or rows != spec.shape[1]:
                raise ValueError(
                    self._mismatch(full_names, [p.shape for p in pieces], spec.shape[1:], transform)
                )
            np.concatenate(pieces, axis=0, out=out[i], casting="unsafe")
        self._set(path, self._place(path, out))

    def stacked_experts(self, path: str, names: tuple[str, ...], num_experts: int) -> None:
        """The param at `path` [L, E, in, out] is, for layer i and expert j, the tensors
        `names` formatted with j ("experts.{}.w1.weight", torch's [out, in]) concatenated
        along their first axis and transposed: ragged_dot's layout (layers/moe.py)."""
        path = self._in_stack(path)
        spec = self._spec(path)
        layer_names = [
            [
                [self._layer_prefix.format(i) + n.format(j) for n in names]
                for j in range(num_experts)
            ]
            for i in self._layer_range()
        ]
        if self._set_quantized(path, spec, layer_names, experts=True):
            return
        out = aligned_empty(spec.shape, spec.dtype)
        for i, layer in enumerate(self._layer_range()):
            for j in range(num_experts):
                full_names = [self._layer_prefix.format(layer) + n.format(j) for n in names]
                pieces = [self._get(n) for n in full_names]
                rows = sum(p.shape[0] for p in pieces)
                if any(p.shape[1:] != spec.shape[2:3] for p in pieces) or rows != spec.shape[3]:
                    expected = (spec.shape[3], spec.shape[2])
                    raise ValueError(
                        self._mismatch(full_names, [p.shape for p in pieces], expected)
                    )
                out[i, j] = np.concatenate(pieces, axis=0).T
        self._set(path, self._place(path, out))

    def _layer_range(self) -> range:
        return range(self._first_layer, self._first_layer + self._num_layers)

    def _in_stack(self, path: str) -> str:
        """A stacked param's path in the stack set_layers names."""
        if path.startswith("layers.") and self._stack != "layers":
            return self._stack + path[len("layers") :]
        return path

    def _set_packed(self, path, spec, layer_names, transform, stack: bool) -> bool:
        """Set the param at `path` as the GGUF blocks of the tensors `layer_names` ([L][pieces],
        one row of pieces when not `stack`) if they can stay packed (quantized_params.py);
        whether it did."""
        if self._get_lazy is None or transform is not None:
            return False
        sources = [[self._get_lazy(n) for n in names] for names in layer_names]
        weight = packed_weight(self._place, path, spec, sources, stack)
        if weight is not None:
            self._set(path, weight)
        return weight is not None

    def _set_quantized(self, path, spec, layer_names, experts: bool) -> bool:
        """Set the param at `path` as the IntWeight / FP8Weight of the pre-quantized tensors
        `layer_names` ([L][pieces], an expert stack's [L][E][pieces]) if all are quantized
        alike and fit `spec` (quantized_params.py); whether it did."""
        if self._quantized is None:
            return False
        weight = quantized_weight(self._quantized, self._place, path, spec, layer_names, experts)
        if weight is not None:
            self._set(path, weight)
        return weight is not None

    def _dequantized_or_float(self, get, name: str) -> np.ndarray:
        """The tensor `name` as floats: a pre-quantized weight dequantized, any other as
        stored."""
        host = self._quantized(name)
        if host is None:
            return get(name)
        self._dequantized.append(name)
        return host.dequantize()

    def params(self) -> dict:
        """The filled params dict; every declared param must have been given. Logs the
        quantized tensors that were read as floats (their layers or fused pieces differ in
        format, or the family transforms them), which take the model dtype's bytes."""
        if self._dequantized:
            logger.info(
                "dequantized %d quantized checkpoint tensors at load, kept in the model dtype "
                "(a stack whose layers or fused pieces differ in format, or a family's own "
                "layout): %s%s",
                len(self._dequantized),
                ", ".join(self._dequantized[:4]),
                ", ..." if len(self._dequantized) > 4 else "",
            )
        missing = [
            path
            for path, _ in _flatten(self._shapes)
            if _lookup(self._params, path.split(".")) is None
        ]
        if missing:
            raise ValueError(f"the checkpoint gave no weights for {missing}")
        return self._params

    def _spec(self, path: str) -> jax.ShapeDtypeStruct:
        spec = _lookup(self._shapes, path.split("."))
        if not isinstance(spec, jax.ShapeDtypeStruct):
            raise KeyError(f"the model declares no param {path!r}")
        return spec

    def _set(self, path: str, value: jax.Array) -> None:
        *parents, leaf = path.split(".")
        node = self._params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    @staticmethod
    def _mismatch(names, shapes, expected, transform=None) -> str:
        got = ", ".join(f"{n!r} {tuple(s)}" for n, s in zip(names, shapes))
        if transform is not None:
            got += " (after the family's transform)"
        return (
            f"checkpoint tensor {got} does not match the config: the model needs "
            f"{tuple(expected)}{' (concatenated along axis 0)' if len(names) > 1 else ''}; "
            "is config.json the one these weights were saved with?"
        )


class WholePlacer:
    """Puts each param whole on JAX's default device: what CheckpointWeights places with when
    it is given no placer (distributed/tensor_parallel.py's ParamPlacer cuts them over a mesh,
    with the same methods)."""

    def __call__(self, path: str, x: np.ndarray) -> jax.Array:
        return jax.device_put(x, may_alias=True)

    def place_quantized(self, path: str, fields: dict, experts: bool) -> dict:
        return {k: self(path, v) for k, v in fields.items()}

    def place_blocks(self, path: str, fields: dict, rows: tuple[int, int] | None = None) -> dict:
        return {k: self(path, v) for k, v in fields.items()}

    def cuts_input(self, path: str, experts: bool) -> bool:
        return False

    def output_rows_unit(self, path: str, experts: bool) -> int | None:
        return None


def _read(x):
    """A lazy tensor's float values; an array as it is."""
    return x.read() if hasattr(x, "read") else x


def _lookup(tree: dict, keys: list[str]) -> Any:
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def is_after_last_layer(name: str, num_layers: int) -> bool:
    """Whether the checkpoint's tensor `name` is under model.layers.{i}. with i past the model's
    `num_layers`: a multi-token-prediction layer kept after the last (DeepSeek-V3's, GLM-4.5's,
    MiniMax-M2's)."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer[1]) >= num_layers
