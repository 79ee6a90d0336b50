"""Which checkpoint modules each adapter-taking projection is made of, per layer.

A family's `load_weights` names, for each param, the HF tensors it concatenates
(models/weights.py). Replayed against a recorder instead of a checkpoint, it tells which
HF module ("model.layers.3.self_attn.k_proj") is which rows of which fused projection
("layers.attn.qkv", rows N*H .. (N+K)*H): where a PEFT adapter's A and B go. A family that
transforms a tensor on its way in (GPT-2's transposed Conv1D, GPT-NeoX's interleaved q|k|v)
records its modules as not taking adapters.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jvllm.config import ModelConfig
from jvllm.models.model import param_segments, param_shapes
from jvllm.models.registry import model_class


@dataclasses.dataclass(frozen=True)
class ModulePiece:
    """One HF module of one layer: rows `rows` of the projection at `path` ("layers.attn.qkv"),
    layer `layer` of that stack, its A and B in the slot's column block `block`."""

    path: str
    layer: int
    rows: slice
    block: int


@dataclasses.dataclass(frozen=True)
class ModuleMap:
    pieces: dict[str, ModulePiece]  # HF module name -> where it goes
    refused: frozenset[str]  # HF modules whose tensors the loader transforms
    # The adapter-taking projections: path -> (layers in the stack, O, I, pieces a slot).
    projections: dict[str, tuple[int, int, int, int]]


@functools.cache
def module_map(config: ModelConfig) -> ModuleMap:
    """The map of `config` (one with max_loras > 0, so its projections declare adapter slots)."""
    recorder = _Recorder(config)
    model_class(config.architecture).load_weights(config, recorder)
    return ModuleMap(recorder.pieces, frozenset(recorder.refused), recorder.projections)


class _Recorder:
    """CheckpointWeights' interface, recording where each module's rows go instead of reading."""

    def __init__(self, config: ModelConfig):
        self._shapes = param_shapes(config)
        self._segments = param_segments(config)
        self._layer_prefix = "model.layers.{}."
        self._first_layer, self._num_layers = 0, config.num_layers
        self._stack = "layers"
        self.pieces: dict[str, ModulePiece] = {}
        self.refused: set[str] = set()
        self.projections: dict[str, tuple[int, int, int, int]] = {}

    def has(self, name: str) -> bool:
        return True  # the HF class's own naming, where a family accepts two

    def set_layer_prefix(self, layer_prefix: str) -> None:
        self._layer_prefix = layer_prefix

    def set_layers(self, first_layer: int, num_layers: int, stack: str = "layers") -> None:
        self._first_layer, self._num_layers, self._stack = first_layer, num_layers, stack

    def tensor(self, path, name, transform=None) -> None:
        pass  # not stacked: embeddings and LM heads take no adapters

    def stacked_experts(self, path, names, num_experts) -> None:
        pass  # routed experts take no adapters

    def stacked(self, path: str, names: tuple[str, ...], transform=None) -> None:
        if path.startswith("layers.") and self._stack != "layers":
            path = self._stack + path[len("layers") :]
        if not path.endswith(".weight"):
            return
        module = path[: -len(".weight")]
        node = _lookup(self._shapes, module)
        modules = [n[: -len(".weight")] for n in names if n.endswith(".weight")]
        layers = range(self._first_layer, self._first_layer + self._num_layers)
        full = lambda m: [self._layer_prefix.format(i) + m for i in layers]
        if not isinstance(node, dict) or "lora_a" not in node or len(modules) != len(names):
            return
        rows = _piece_rows(node["weight"].shape[1], self._segments_of(module), len(modules))
        if transform is not None or rows is None:
            self.refused.update(n for m in modules for n in full(m))
            return
        num_layers, _, num_inputs = node["lora_a"].shape  # [L, S*W', I]
        self.projections[module] = (num_layers, node["weight"].shape[1], num_inputs, len(modules))
        for block, (module_name, piece_rows) in enumerate(zip(modules, rows)):
            for layer, name in enumerate(full(module_name)):
                self.pieces[name] = ModulePiece(module, layer, piece_rows, block)

    def _segments_of(self, module: str):
        node = _lookup(self._segments, module)
        return node.get("weight") if isinstance(node, dict) else None


def _piece_rows(num_rows: int, segments, num_modules: int) -> list[slice] | None:
    """The rows of each of `num_modules` modules concatenated into `num_rows`: all of them for
    one module, else one fused piece (`segments`, layers/params.py) each; None when they do
    not line up."""
    if num_modules == 1:
        return [slice(0, num_rows)]
    if segments is None or len(segments) != num_modules:
        return None
    sizes = [count * unit for count, unit in segments]
    ends = np.cumsum(sizes).tolist()
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def _lookup(tree: dict, path: str):
    node = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node
