"""New weights for a running engine from HF-named tensors (vLLM's `model.load_weights`): which
params they make, read through the family's own loader (models/*.py `load_weights`) into host
arrays in the params' layout, for the worker to place where the old ones lie (worker/worker.py).

A stacked param is made of every layer's tensors, and a fused one of several (q, k, v into
q|k|v): a subset of the model is taken, param by param, but never part of a param.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from jvllm.config import ModelConfig
from jvllm.models.model import param_shapes
from jvllm.models.registry import model_class
from jvllm.models.weights import CheckpointWeights

# Names a model's state_dict() may carry that no param is made of: rotary tables saved as
# buffers; a tied LM head is the embedding again (see `_ignored`).
_ROTARY_TABLE = "rotary_emb.inv_freq"
# transformers 5 holds a MoE layer's experts fused in memory (experts.gate_up_proj [E, 2F, D]),
# where the family's checkpoints (and load_weights) name each expert's tensors.
_FUSED_EXPERTS = "experts.gate_up_proj"
_CHECKPOINT_NAMES_HINT = (
    "; these are a transformers model's in-memory names of its fused experts: give the "
    "checkpoint's names, e.g. transformers.core_model_loading.revert_weight_conversion(model, "
    "model.state_dict()).items()"
)


def read_weight_update(
    config: ModelConfig, weights: Iterable[tuple[str, object]], layout: Callable | None = None
) -> dict:
    """(HF name, array) pairs -> {param path: host array} for every param they make whole; a
    ValueError naming the tensors missing from a param given in part, or names no param of
    `config`'s family is made of. Arrays may be NumPy or anything np.asarray reads (torch CPU
    tensors, jax arrays). `layout(path, array)`: each param's host array in the layout the
    engine holds it in (tensor_parallel.ParamPlacer.host_layout under tensor parallelism)."""
    given = {name: value for name, value in weights if not _ignored(config, name)}
    plan = _param_names(config, given)
    used = {name for names in plan.values() for name in names}
    unknown = sorted(set(given) - used)
    if unknown:
        fused = any(_FUSED_EXPERTS in name for name in unknown)
        raise ValueError(
            f"load_weights: {config.architecture} has no param made of {_listed(unknown)}"
            + (_CHECKPOINT_NAMES_HINT if fused else "")
        )
    partial = {
        path: [n for n in names if n not in given]
        for path, names in plan.items()
        if any(n in given for n in names) and not all(n in given for n in names)
    }
    if partial:
        path, missing = next(iter(partial.items()))
        raise ValueError(
            f"load_weights: the param {path!r} is fused from several tensors, which must come "
            f"in the same call; missing {_listed(missing)} ({len(partial)} params given in part)"
        )
    complete = {path for path, names in plan.items() if all(n in given for n in names)}
    get = lambda name: _as_numpy(given[name])
    loader = _SomeParams(get, param_shapes(config), config.num_layers, complete, layout)
    model_class(config.architecture).load_weights(config, loader)
    return loader.loaded


def _as_numpy(value) -> np.ndarray:
    """A tensor as NumPy; a torch bfloat16 one through float32 (NumPy has no bfloat16 of
    torch's), which the loader casts to the model dtype again."""
    if str(getattr(value, "dtype", "")) == "torch.bfloat16":
        value = value.float()
    if hasattr(value, "detach"):  # torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _ignored(config: ModelConfig, name: str) -> bool:
    return name.endswith(_ROTARY_TABLE) or (config.tie_word_embeddings and name == "lm_head.weight")


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:6])
    return shown + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


def _param_names(config: ModelConfig, given: dict) -> dict[str, list[str]]:
    """{param path: the HF names it is made of}, the family's loader replayed without reading
    (`has` answers from `given`, for families that accept two namings)."""

    def get(name: str):
        if name not in given:
            raise KeyError(name)
        return given[name]

    recorder = _NameRecorder(get, param_shapes(config), config.num_layers)
    model_class(config.architecture).load_weights(config, recorder)
    return recorder.names


class _NameRecorder(CheckpointWeights):
    """CheckpointWeights' interface, recording each param's tensor names instead of reading."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.names: dict[str, list[str]] = {}

    def tensor(self, path, name, transform=None) -> None:
        self.names[path] = [name]

    def stacked(self, path, names, transform=None) -> None:
        self.names[self._in_stack(path)] = [
            self._layer_prefix.format(i) + n for i in self._layer_range() for n in names
        ]

    def stacked_experts(self, path, names, num_experts) -> None:
        self.names[self._in_stack(path)] = [
            self._layer_prefix.format(i) + n.format(j)
            for i in self._layer_range()
            for j in range(num_experts)
            for n in names
        ]


class _SomeParams(CheckpointWeights):
    """CheckpointWeights that builds only the params `paths`, on the host."""

    def __init__(self, get, shapes, num_layers, paths: set[str], layout=None) -> None:
        super().__init__(get, shapes, num_layers, place=layout or (lambda path, x: x))
        self._paths = paths
        self.loaded: dict[str, np.ndarray] = {}

    def tensor(self, path, name, transform=None) -> None:
        if path in self._paths:
            super().tensor(path, name, transform)

    def stacked(self, path, names, transform=None) -> None:
        if self._in_stack(path) in self._paths:
            super().stacked(path, names, transform)

    def stacked_experts(self, path, names, num_experts) -> None:
        if self._in_stack(path) in self._paths:
            super().stacked_experts(path, names, num_experts)

    def _set(self, path: str, value: np.ndarray) -> None:
        self.loaded[path] = value
