"""A pre-quantized checkpoint's `quantization_config` (config.json), read as vLLM reads it:
compressed-tensors (llmcompressor), GPTQ (GPTQModel / AutoGPTQ), AWQ (AutoAWQ) and FP8
(block-scaled, as Qwen3-*-FP8 and DeepSeek-V3 ship).

`checkpoint_quantization` checks the whole config before any weight is read: an unsupported
method, scheme, bit width, group size or packing format is a ValueError naming the field, its
value and what is supported. What it gives, `CheckpointQuantization`, answers for each linear
module of the checkpoint how its weight is stored (`scheme_for`), which
model_loader/quantized_tensors.py then reads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from jvllm.quantization import CHECKPOINT_METHODS, METHOD_ALIASES

_INT_BITS = (4, 8)
_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one module's weight is stored.

    format: "pack-quantized" | "naive-quantized" | "int-quantized" | "float-quantized"
    (compressed-tensors), "gptq", "gptq_v2", "awq" or "fp8"; bits: 4 or 8; group_size: input
    columns per scale, None for one scale per output channel; symmetric: no zero points;
    block: FP8's (rows, columns) per scale, None for a scale per channel or per tensor;
    per_tensor: FP8 with one scale for the whole weight; activations: what the scheme quantizes
    activations to ("int8" / "fp8"), None for weight-only."""

    format: str
    bits: int
    group_size: int | None = None
    symmetric: bool = True
    block: tuple[int, int] | None = None
    per_tensor: bool = False
    activations: str | None = None

    @property
    def is_float(self) -> bool:
        return self.format in ("float-quantized", "fp8")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """method: one of CHECKPOINT_METHODS; groups: (targets, scheme) in the config's order, the
    first whose targets match a module giving its scheme; ignore: the modules (names, or "re:"
    patterns) left unquantized."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()
    kv_cache_scheme: Mapping[str, Any] | None = None

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of module `module` ("model.layers.0.self_attn.q_proj"), None where the
        checkpoint leaves it unquantized."""
        if any(matches_module(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or matches_module(t, module) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        """For the start-up log, e.g. "compressed-tensors pack-quantized int4 group 128", "fp8
        e4m3 block 128x128"."""
        parts = []
        for _, s in self.groups:
            if s.is_float:
                how = f"block {s.block[0]}x{s.block[1]}" if s.block else "per-channel"
                how = "per-tensor" if s.per_tensor else how
                parts.append(f"{self._format(s)}e4m3 {how}")
            else:
                how = f"group {s.group_size}" if s.group_size else "per-channel"
                sym = "" if s.symmetric else " asymmetric"
                parts.append(f"{self._format(s)}int{s.bits} {how}{sym}")
        return f"{self.method} " + ", ".join(dict.fromkeys(parts))

    def _format(self, scheme: WeightScheme) -> str:
        """A scheme's format for the log, where it says more than the method."""
        return "" if scheme.format == self.method else f"{scheme.format} "


def matches_module(pattern: str, module: str) -> bool:
    """Whether a config's target / ignore entry names `module`: "re:" patterns match from the
    start, a name matches itself or the module's last names ("lm_head", "mlp.gate")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def checkpoint_quantization(hf_config: Mapping[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization from its config.json (None for a float checkpoint);
    ValueError for one jvllm cannot run."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: model_loader/mxfp4.py reads them
        return None
    readers = {
        "compressed-tensors": _compressed_tensors,
        "gptq": _gptq,
        "awq": _awq,
        "fp8": _fp8,
    }
    if method not in readers:
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported; jvllm reads the "
            f"pre-quantized formats {CHECKPOINT_METHODS} (GGUF files load from a .gguf path)"
        )
    return readers[method](qc)


def check_requested_method(requested: str | None, found: CheckpointQuantization | None) -> None:
    """An explicit `quantization=` must agree with the checkpoint's own: ValueError naming both.
    (None, or a float checkpoint quantized at load with "int8" / "fp8", always agrees.)"""
    if requested is None or found is None:
        return
    requested = METHOD_ALIASES.get(requested, requested)
    if requested != found.method:
        raise ValueError(
            f"quantization={requested!r} disagrees with the checkpoint, whose config.json "
            f"says quantization_config.quant_method={found.method!r}; pass "
            f"quantization={found.method!r} or None (the checkpoint's own is then used)"
        )


def _field(where: str, name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{where}.{name}={value!r} is not supported; supported: {allowed}")


def _block(where: str, name: str, value: Any) -> tuple[int, int]:
    """An FP8 block shape: [rows, columns], both positive ints."""
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(v, int) and v > 0 for v in value):
        raise _field(where, name, value, "[rows, columns] of positive ints")
    return tuple(value)


def _group_size(where: str, value: Any) -> int | None:
    """A config's group size: None for per-channel (-1 / None), else a positive int."""
    if value is None or value == -1:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _field(where, "group_size", value, "a positive int, or -1 (one group a row)")
    return value


def _compressed_tensors(qc: Mapping[str, Any]) -> CheckpointQuantization:
    where = "quantization_config"
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise _field(where, "quantization_status", status, "'compressed'")
    if qc.get("sparsity_config"):
        raise _field(where, "sparsity_config", qc["sparsity_config"], "none (dense weights)")
    if qc.get("transform_config"):  # SpinQuant / QuIP rotations applied at run time
        raise _field(where, "transform_config", qc["transform_config"], "none")
    if not isinstance(qc.get("config_groups") or {}, Mapping):
        raise _field(where, "config_groups", qc["config_groups"], "a mapping of groups")
    top_format = qc.get("format")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        at = f"{where}.config_groups.{name}"
        weights = group.get("weights")
        if not weights:
            raise _field(at, "weights", weights, "a weight scheme (activation-only is not)")
        fmt = group.get("format") or top_format
        if fmt not in _CT_FORMATS:
            raise _field(at, "format", fmt, ", ".join(map(repr, _CT_FORMATS)))
        scheme = _ct_scheme(f"{at}.weights", weights, fmt, group.get("input_activations"))
        if not group.get("targets"):
            allowed = "a list of module names or 're:' patterns"
            raise _field(at, "targets", group.get("targets"), allowed)
        groups.append((tuple(group["targets"]), scheme))
    if not groups:
        raise _field(where, "config_groups", qc.get("config_groups"), "at least one group")
    ignore = tuple(qc.get("ignore") or ())
    kv_scheme = qc.get("kv_cache_scheme")
    return CheckpointQuantization("compressed-tensors", tuple(groups), ignore, kv_scheme)


def _ct_scheme(
    where: str, w: Mapping[str, Any], fmt: str, activations: Mapping[str, Any] | None
) -> WeightScheme:
    kind, bits = w.get("type", "int"), w.get("num_bits")
    strategy = w.get("strategy")
    acts = None
    if activations:
        is_float = activations.get("type") == "float"
        acts = "fp8" if is_float else f"int{activations.get('num_bits', 8)}"
    if kind == "float":
        if fmt != "float-quantized" or bits != 8:
            raise ValueError(
                f"{where}: float weights of {bits} bits in format {fmt!r} are not supported; "
                "supported: 8-bit float (FP8 e4m3) in 'float-quantized'"
            )
        if strategy not in ("tensor", "channel", "block"):
            raise _field(where, "strategy", strategy, "'tensor', 'channel' or 'block' for FP8")
        block = None
        if strategy == "block":
            block = _block(where, "block_structure", w.get("block_structure"))
        return WeightScheme(fmt, 8, block=block, per_tensor=strategy == "tensor", activations=acts)
    if kind != "int":
        raise _field(where, "type", kind, "'int' or 'float'")
    if fmt == "float-quantized":
        raise _field(where, "type", kind, "'float' in format 'float-quantized'")
    if bits not in _INT_BITS or (fmt != "pack-quantized" and bits != 8):
        allowed = "4 or 8 ('pack-quantized'), 8 ('naive-quantized', 'int-quantized')"
        raise _field(where, "num_bits", bits, allowed)
    if strategy not in ("channel", "group"):
        raise _field(where, "strategy", strategy, "'channel' or 'group' for int weights")
    group_size = _group_size(where, w.get("group_size")) if strategy == "group" else None
    if strategy == "group" and group_size is None:
        raise _field(where, "group_size", w.get("group_size"), "a positive int")
    return WeightScheme(fmt, bits, group_size, bool(w.get("symmetric", True)), activations=acts)


def _gptq(qc: Mapping[str, Any]) -> CheckpointQuantization:
    where = "quantization_config"
    fmt = qc.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _field(where, "checkpoint_format", fmt, "'gptq' or 'gptq_v2'")
    base = _gptq_scheme(where, qc, fmt)
    groups, ignore = [], list(qc.get("modules_to_not_convert") or ())
    # GPTQModel's per-module overrides: "-:pattern" skips modules, "+:pattern" (or a bare
    # pattern) changes bits / group_size / sym / desc_act for them.
    for key, override in (qc.get("dynamic") or {}).items():
        if key.startswith("-:"):
            ignore.append("re:" + key[2:])
            continue
        pattern = key.removeprefix("+:")
        merged = {**qc, **(override or {})}
        groups.append((("re:" + pattern,), _gptq_scheme(f"{where}.dynamic[{key!r}]", merged, fmt)))
    groups.append((("Linear",), base))
    return CheckpointQuantization("gptq", tuple(groups), tuple(ignore))


def _gptq_scheme(where: str, qc: Mapping[str, Any], fmt: str) -> WeightScheme:
    bits = qc.get("bits")
    if bits not in _INT_BITS:
        raise _field(where, "bits", bits, "4 or 8")
    return WeightScheme(
        fmt, bits, _group_size(where, qc.get("group_size")), bool(qc.get("sym", True))
    )


def _awq(qc: Mapping[str, Any]) -> CheckpointQuantization:
    where = "quantization_config"
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _field(where, "version", qc.get("version"), "'gemm' (AutoAWQ's GEMM layout)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _field(where, "bits", bits, "4")
    if not qc.get("zero_point", True):
        raise _field(where, "zero_point", qc.get("zero_point"), "true")
    group_size = _group_size(where, qc.get("group_size", qc.get("q_group_size")))
    scheme = WeightScheme("awq", 4, group_size, symmetric=False)
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return CheckpointQuantization("awq", ((("Linear",), scheme),), ignore)


def _fp8(qc: Mapping[str, Any]) -> CheckpointQuantization:
    where = "quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _field(where, "fmt", qc.get("fmt"), "'e4m3'")
    scheme_name = qc.get("activation_scheme", "dynamic")
    if scheme_name not in ("dynamic", "static"):
        raise _field(where, "activation_scheme", scheme_name, "'dynamic' or 'static'")
    block = qc.get("weight_block_size")
    block = None if block is None else _block(where, "weight_block_size", block)
    scheme = WeightScheme(
        "fp8",
        8,
        block=block,
        per_tensor=block is None,
        activations="fp8",
    )
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    return CheckpointQuantization("fp8", ((("Linear",), scheme),), ignore)
