"""Freeing and refilling a model runner's device buffers (its params, its KV cache and the
token ids beside it) while its executables stay compiled: every refilled array takes the
shape, dtype and sharding the executables were lowered for (the runner's `_state_spec`), so
nothing compiles again. The Worker (worker/worker.py) drives these between RL training steps.

A param here is a leaf of the params tree as the model takes it: an array, a quantized weight
of several arrays, or a stacked weight split by layers (layers/scan.py's `Unstacked`); it is
named by its dotted path ("layers.attn.qkv.weight").

Where the runner's arrays span several processes (tensor parallelism across hosts, a group of
data-parallel ranks: distributed/multihost.py), each process keeps its own devices' pieces in
host memory and puts them back on the same devices, every process in the same call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.layers.scan import Unstacked, is_unstacked

HostParams = dict[str, Any]  # param path -> its arrays on the host, in the runner's layout


@dataclasses.dataclass
class HostShards:
    """The pieces of an array that spans several processes that this process's devices hold,
    in host memory, by where each lies in the whole."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: dict[tuple, np.ndarray]  # _index_key(piece's index) -> its values

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return self.pieces[_index_key(index)]


def param_specs(runner) -> dict[str, Any]:
    """Each param's ShapeDtypeStruct(s), by path: what it must be when put back."""
    return dict(_flatten(runner._state_spec[0]))


def release_kv_cache(runner) -> None:
    """Delete the KV cache and the token ids of its pages (their contents are lost)."""
    runner._ahead = None  # a step run ahead reads them
    _delete((runner.kv_cache, runner.token_cache))
    runner.kv_cache = runner.token_cache = None


def restore_kv_cache(runner) -> None:
    """A zero KV cache and zero token ids, laid out as before release_kv_cache."""
    zeros = lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding)
    _, kv_spec, token_spec, _ = runner._state_spec
    runner.kv_cache = jax.tree.map(zeros, kv_spec)
    runner.token_cache = zeros(token_spec)


def release_params(runner, keep_on_host) -> HostParams:
    """Delete every param from the device; -> host copies of those whose path `keep_on_host`
    accepts (the others are lost)."""
    host = {
        path: jax.tree.map(_to_host, param)
        for path, param in _flatten(runner.params)
        if keep_on_host(path)
    }
    _delete(runner.params)
    runner.params = None
    return host


def release_draft_params(runner) -> tuple[Any, Any]:
    """Move a speculative draft's params (a draft model's or head's) to host memory, at every
    sleep level: no training step updates a draft, and nothing else would bring it back.
    -> (host copies, their ShapeDtypeStructs) for restore_draft_params."""
    params = runner.draft.params
    specs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
    )
    host = jax.tree.map(_to_host, params)
    _delete(params)
    runner.draft.params = None
    return host, specs


def restore_draft_params(runner, saved: tuple[Any, Any]) -> None:
    """Put release_draft_params' host copies back on the device, laid out as before."""
    host, specs = saved
    runner.draft.params = jax.tree.map(_on_devices, host, specs)


def restore_params(runner, host: HostParams) -> None:
    """Put `host` (every param) back on the device as the runner's params."""
    specs = param_specs(runner)
    runner.params = _unflatten({path: _put(host[path], specs[path], path) for path in specs})


def replace_params(runner, host: HostParams) -> None:
    """Swap the params in `host` (some of them) for the runner's, each old one deleted once its
    new one is on the device, so that the device never holds two copies of the model."""
    specs = param_specs(runner)
    for path, value in host.items():
        *parents, leaf = path.split(".")
        node = runner.params
        for key in parents:
            node = node[key]
        new = _put(value, specs[path], path)
        _delete(node[leaf])
        node[leaf] = new


def in_runner_layout(runner, path: str, value: np.ndarray) -> Any:
    """A stacked param [L, ...] from the loaders as the runner holds it: split into its layers
    where the runner runs them unstacked."""
    if is_unstacked(param_specs(runner)[path]):
        return Unstacked(tuple(value[i] for i in range(value.shape[0])))
    return value


def _put(value: Any, spec: Any, path: str) -> Any:
    """`value`'s arrays on the device, each laid out as its ShapeDtypeStruct in `spec`."""

    def put(array: np.ndarray | HostShards, s: jax.ShapeDtypeStruct) -> jax.Array:
        if (tuple(array.shape), array.dtype) != (s.shape, s.dtype):
            raise ValueError(
                f"param {path!r}: got {array.dtype}{list(array.shape)}, the compiled model "
                f"takes {s.dtype}{list(s.shape)}"
            )
        return _on_devices(array, s)

    return jax.tree.map(put, value, spec)


def _to_host(array: jax.Array) -> np.ndarray | HostShards:
    """A copy of `array` in host memory (not a view of its buffer): whole, or this process's
    pieces of one that spans several processes."""
    if array.is_fully_addressable:
        return np.array(array, copy=True)
    pieces = {_index_key(s.index): np.array(s.data, copy=True) for s in array.addressable_shards}
    return HostShards(array.shape, array.dtype, pieces)


def _on_devices(array: np.ndarray | HostShards, spec: jax.ShapeDtypeStruct) -> jax.Array:
    """`array` (whole, or this process's pieces) on the devices of `spec`'s sharding, each
    given its piece: every process of a sharding that spans several calls this alike."""
    if isinstance(array, np.ndarray) and spec.sharding.is_fully_addressable:
        return jax.device_put(array, spec.sharding)
    return jax.make_array_from_callback(spec.shape, spec.sharding, lambda index: array[index])


def _index_key(index: tuple[slice, ...]) -> tuple:
    """A piece's index (slices, unhashable before Python 3.12) as a dict key."""
    return tuple((s.start, s.stop, s.step) for s in index)


def _delete(tree: Any) -> None:
    for array in jax.tree.leaves(tree):
        if isinstance(array, jax.Array) and not array.is_deleted():
            array.delete()


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree
