"""One linear module's quantized weight read from a checkpoint's tensors, in each format's own
layout, and repacked into the device layout (quantization/host_weights.py).

The layouts, as the tools write them (all int32 words little-endian, element k of a word at
bits [k * b, (k + 1) * b)):
- compressed-tensors pack-quantized: weight_packed i32[O, I * b / 32] packed along I, values
  stored plus 2^(b-1); weight_scale [O, G] ([O, 1] per channel); weight_zero_point (asymmetric)
  i32[O * b / 32, G] packed along O, plus 2^(b-1) too; weight_g_idx i32[I] with act-order.
- compressed-tensors naive-/int-quantized: weight i8[O, I], weight_scale, weight_zero_point i8.
- compressed-tensors float-quantized: weight f8e4m3[O, I], weight_scale [] / [O, 1] / blocks.
- GPTQ: qweight i32[I * b / 32, O] packed along I; qzeros i32[G, O * b / 32] packed along O,
  stored minus one (v1; GPTQModel's gptq_v2 stores them as they are); scales [G, O]; g_idx
  i32[I], each column's group (act-order sorts them).
- AWQ (GEMM): qweight i32[I, O / 8] packed along O in the order 0, 2, 4, 6, 1, 3, 5, 7;
  qzeros i32[G, O / 8] alike; scales [G, O].
- FP8: weight f8e4m3[O, I], weight_scale_inv [O / bo, I / bi] (weight_scale [] per tensor).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jvllm.model_loader.quant_config import WeightScheme
from jvllm.quantization.host_weights import HostQuantized, fp8_weight, int_weight

_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble k of a word holds column 8c + order[k]
# Tensors of a quantized module that no step reads: the shape compressed-tensors records and
# static activation scales (jvllm runs the weights with unquantized activations).
_EXTRA = ("weight_shape", "input_scale", "output_scale", "input_zero_point")


def has_quantized(tensors: Mapping[str, np.ndarray], module: str) -> bool:
    """Whether `module`'s weight is stored quantized (not as a float `weight`)."""
    if f"{module}.weight_packed" in tensors or f"{module}.qweight" in tensors:
        return True
    weight = tensors.get(f"{module}.weight")
    return weight is not None and weight.dtype.itemsize == 1


def read_quantized(
    tensors: Mapping[str, np.ndarray], module: str, scheme: WeightScheme
) -> tuple[HostQuantized, list[str]]:
    """(module's weight in the device layout, the checkpoint names it read)."""
    reader = {
        "pack-quantized": _pack_quantized,
        "naive-quantized": _naive_quantized,
        "int-quantized": _naive_quantized,
        "float-quantized": _float_quantized,
        "gptq": _gptq,
        "gptq_v2": _gptq,
        "awq": _awq,
        "fp8": _fp8,
    }[scheme.format]
    read: list[str] = []

    def get(suffix: str, optional: bool = False) -> np.ndarray | None:
        name = f"{module}.{suffix}"
        if name not in tensors:
            if optional:
                return None
            raise ValueError(
                f"checkpoint has no tensor {name!r}, which its quantization_config's "
                f"{scheme.format!r} format stores for {module!r}"
            )
        read.append(name)
        return tensors[name]

    weight = reader(get, scheme)
    read.extend(f"{module}.{s}" for s in _EXTRA if f"{module}.{s}" in tensors)
    return weight, read


def unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """i32[..., n] -> u8[..., n * 32 / bits]: element k of the little-endian bit stream."""
    if words.dtype != np.int32:
        raise ValueError(
            f"a packed tensor must be int32 words, got {words.dtype} {list(words.shape)}: is "
            "the checkpoint's packing the format's?"
        )
    data = np.ascontiguousarray(words).astype("<i4").view(np.uint8)  # [..., 4n]
    if bits == 8:
        return data
    return np.stack([data & 15, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)


def _pack_quantized(get, scheme: WeightScheme) -> HostQuantized:
    num_out, num_in = (int(n) for n in get("weight_shape"))
    values = unpack_words(get("weight_packed"), scheme.bits)[:, :num_in]  # [O, I] unsigned
    zero = None
    if scheme.symmetric:
        get("weight_zero_point", optional=True)  # older writers keep the offset's zeros
    else:
        packed_zero = get("weight_zero_point")  # [O * b / 32, G], packed along O
        zero = unpack_words(packed_zero.T, scheme.bits)[:, :num_out].T  # [O, G] unsigned
    return int_weight(
        values, get("weight_scale"), zero, scheme.bits, scheme.group_size, _g_idx(get)
    )


def _naive_quantized(get, scheme: WeightScheme) -> HostQuantized:
    signed = get("weight").view(np.int8)  # [O, I]
    offset = 1 << (scheme.bits - 1)
    zero = None
    if scheme.symmetric:
        get("weight_zero_point", optional=True)  # zeros, where the writer kept them
    else:
        zero = get("weight_zero_point").view(np.int8).astype(np.int16) + offset
    values = (signed.astype(np.int16) + offset).astype(np.uint8)
    return int_weight(values, get("weight_scale"), zero, 8, scheme.group_size, _g_idx(get))


def _float_quantized(get, scheme: WeightScheme) -> HostQuantized:
    block = scheme.block
    values = get("weight")
    scale = get("weight_scale")
    if block is None and not scheme.per_tensor:
        block = (1, values.shape[1])
    return fp8_weight(values, scale, block, scheme.activations == "fp8")


def _gptq(get, scheme: WeightScheme) -> HostQuantized:
    bits = scheme.bits
    values = unpack_words(get("qweight").T, bits)  # [O, I]
    zero = unpack_words(get("qzeros"), bits)[:, : values.shape[0]].astype(np.int16)  # [G, O]
    if scheme.format == "gptq":
        zero = zero + 1  # v1 stores zero points minus one
    scale = get("scales").T  # [O, G]
    return int_weight(values, scale, zero.T, bits, scheme.group_size, _g_idx(get, "g_idx"))


def _awq(get, scheme: WeightScheme) -> HostQuantized:
    def unpack_awq(words: np.ndarray) -> np.ndarray:  # i32[n, O / 8] -> u8[n, O]
        nibbles = unpack_words(words, 4).reshape(words.shape[0], -1, 8)
        return nibbles[:, :, np.argsort(_AWQ_ORDER)].reshape(words.shape[0], -1)

    values = unpack_awq(get("qweight")).T  # [O, I]
    zero = unpack_awq(get("qzeros")).T.astype(np.int16)  # [O, G]
    return int_weight(values, get("scales").T, zero, 4, scheme.group_size)


def _fp8(get, scheme: WeightScheme) -> HostQuantized:
    acts = scheme.activations == "fp8"
    if scheme.block is not None:
        return fp8_weight(get("weight"), get("weight_scale_inv"), scheme.block, acts)
    return fp8_weight(get("weight"), get("weight_scale"), None, acts)


def _g_idx(get, name: str = "weight_g_idx") -> np.ndarray | None:
    g_idx = get(name, optional=True)
    return None if g_idx is None else np.asarray(g_idx, np.int64)
