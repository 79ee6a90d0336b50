"""Pre-quantized checkpoints made as the tools users use make them, from a float HF directory,
and each one's reference: its weights dequantized as the format's own code computes them.

- compressed-tensors: the scales and zero points llmcompressor's data-free min-max observer
  gives (compressed_tensors.quantization.utils.calculate_qparams over each group, channel or
  block), then compressed_tensors' own compressor for the format writes the tensors, and its
  own decompressor is the reference. (llmcompressor itself pins transformers <= 5.17, older
  than the project's; compressed_tensors is the library it writes checkpoints with.)
- GPTQ (v1, as GPTQModel / AutoGPTQ write it) and AWQ (AutoAWQ's GEMM layout): min-max groups
  packed in the documented layouts; the reference is the formula GPTQModel's and AutoAWQ's
  torch paths apply, scales[g_idx] * (q - zeros[g_idx]) in float16.
- FP8 with weight_block_size (DeepSeek-V3's and Qwen3-*-FP8's release format): e4m3 values
  and float32 scale_inv per 128 x 128 block; the reference is values * scale_inv.

`quantize_checkpoint(src, dst, fmt, **options)` writes the quantized directory and returns the
reference state dict {name: float32 tensor}; `save_reference(src, dst, reference)` writes it as a
float HF directory that HF transformers runs. The tests (tests/test_prequantized_*.py) and the
benchmark (prequantized.py) make their checkpoints with it; so can a user:

    python -m jvllm.benchmarks.quantized_checkpoints SRC DST --format gptq --bits 4 \
        --group-size 128

(torch and, for compressed-tensors, the compressed-tensors package: the project's test extra.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from jvllm.model_loader.quant_config import matches_module

# The checkpoint tensors that are linear layers' weights: attention and MLP projections, the
# experts' (Mixtral's w1/w2/w3 too), never a router ("mlp.gate.weight") or the LM head.
_LINEAR = re.compile(r"layers\.\d+\..*(_proj|_proj_with_mqa|\.w[123])\.weight$")


def linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in state if _LINEAR.search(n) and state[n].ndim == 2]


def _read_dir(src: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    state = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(src, name)))
    return config, state


def _write_dir(src: str, dst: str, config: dict, state: dict[str, torch.Tensor]) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"))


def quantize_checkpoint(
    src: str, dst: str, fmt: str, float_dtype: torch.dtype | None = None, **options
) -> dict[str, torch.Tensor]:
    """Write `src` (a float HF directory) quantized in `fmt` ("compressed-tensors", "gptq",
    "awq", "fp8") to `dst`, its other float tensors in `float_dtype` (None: as they are); ->
    the reference {linear weight name: float32 dequantized}."""
    config, state = _read_dir(src)
    if float_dtype is not None:
        state = {k: v.to(float_dtype) if v.is_floating_point() else v for k, v in state.items()}
        config["dtype"] = config["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    writer = {
        "compressed-tensors": _compressed_tensors,
        "gptq": _gptq,
        "awq": _awq,
        "fp8": _fp8_blocks,
    }[fmt]
    quantized, reference, qconfig = writer(state, **options)
    _write_dir(src, dst, {**config, "quantization_config": qconfig}, quantized)
    return reference


def save_reference(src: str, dst: str, reference: dict[str, torch.Tensor]) -> None:
    """`src` with its linear weights replaced by `reference`'s values (float32)."""
    config, state = _read_dir(src)
    state = {k: v.float() for k, v in state.items()}
    state.update({k: v.float() for k, v in reference.items()})
    config["dtype"] = config["torch_dtype"] = "float32"
    _write_dir(src, dst, config, state)


# compressed-tensors ------------------------------------------------------------------------


def _compressed_tensors(
    state,
    scheme: str = "W4A16",
    group_size: int | None = None,
    symmetric: bool | None = None,
    strategy: str | None = None,
    groups: dict[str, str] | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
):
    """`scheme` (a compressed-tensors preset) for every linear layer, with group_size /
    symmetric / strategy changed where given; or `groups`, {"re:" target: preset} in order,
    each layer quantized by the first whose target matches it (none: left in float), each
    group with its own format (the config's "mixed"). `ignore`: the config's ignore list."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    def make_scheme(name: str, targets: list[str]):
        q_scheme = preset_name_to_scheme(name, targets)
        if group_size is not None:
            q_scheme.weights.group_size = group_size
        if symmetric is not None:
            q_scheme.weights.symmetric = symmetric
        if strategy == "channel":
            q_scheme.weights.strategy, q_scheme.weights.group_size = "channel", None
        q_scheme.format = _ct_format(q_scheme)
        return q_scheme

    schemes = [make_scheme(scheme, ["Linear"])] if groups is None else [
        make_scheme(preset, [target]) for target, preset in groups.items()
    ]  # fmt: skip
    out, reference = dict(state), {}
    for name in linear_names(state):
        module = name[: -len(".weight")]
        if any(matches_module(pattern, module) for pattern in ignore):
            continue
        matching = [
            q for q in schemes
            if q.targets == ["Linear"] or matches_module(q.targets[0], module)
        ]  # fmt: skip
        if not matching:
            continue
        q_scheme = matching[0]
        compressor = BaseCompressor.load_from_registry(q_scheme.format)
        args = q_scheme.weights
        w = state[name].to(torch.bfloat16)
        lo, hi = _observed_range(w.float(), args)
        scale, zero = calculate_qparams(lo, hi, args)
        local = {"weight": w, "weight_scale": scale.to(w.dtype)}
        if not args.symmetric:
            local["weight_zero_point"] = zero.to(args.zp_dtype or torch.int8)
        compressed = compressor.compress(local, q_scheme)
        del out[name]
        out.update({f"{module}.{k}": v for k, v in compressed.items()})
        reference[name] = compressor.decompress(compressed, q_scheme)["weight"].float()
    formats = {q.format for q in schemes}
    qconfig = QuantizationConfig(
        config_groups={f"group_{i}": q for i, q in enumerate(schemes)},
        format=formats.pop() if len(formats) == 1 else "mixed",
        quantization_status="compressed",
        ignore=list(ignore),
    ).model_dump(mode="json")
    return out, reference, qconfig


def _ct_format(scheme) -> str:
    """The format llmcompressor picks for a scheme (its infer_quantization_format)."""
    if scheme.weights.type == "float":
        return "float-quantized"
    if scheme.input_activations is not None:
        return "int-quantized"
    return "pack-quantized"


def _observed_range(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max a min-max observer sees for each scale of `args`' strategy."""
    strategy = args.strategy
    if strategy == "group":  # a last group shorter (which compressed-tensors then refuses to
        # write) padded with zeros: they change nothing, the range always holds 0
        pad = -w.shape[1] % args.group_size
        g = torch.nn.functional.pad(w, (0, pad)).reshape(w.shape[0], -1, args.group_size)
        return g.amin(-1), g.amax(-1)
    if strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if strategy == "block":
        bo, bi = args.block_structure
        rows, cols = math.ceil(w.shape[0] / bo), math.ceil(w.shape[1] / bi)
        padded = torch.nn.functional.pad(w, (0, cols * bi - w.shape[1], 0, rows * bo - w.shape[0]))
        blocks = padded.reshape(rows, bo, cols, bi)
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


# GPTQ and AWQ -------------------------------------------------------------------------------


def _min_max_groups(w: np.ndarray, bits: int, group_size: int, symmetric: bool):
    """w f32[O, I] -> (q u8[O, I], scale f16[O, G], zero i32[O, G]) by groups of columns (the
    last one shorter where group_size does not divide I), as GPTQ's quantizer without its error
    feedback: q = clamp(round(w / s) + z, 0, 2^b - 1)."""
    max_q = (1 << bits) - 1
    num_in = w.shape[1]
    padded = np.pad(w, ((0, 0), (0, -num_in % group_size)))  # zeros: the range holds 0 anyway
    groups = padded.reshape(w.shape[0], -1, group_size)
    lo, hi = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)
    if symmetric:
        hi = np.maximum(-lo, hi)
        lo = -hi
    scale = np.maximum((hi - lo) / max_q, 1e-8).astype(np.float16)
    zero = np.full(scale.shape, (max_q + 1) // 2) if symmetric else np.round(-lo / scale)
    zero = np.clip(zero, 0, max_q).astype(np.int32)
    s = scale.astype(np.float32).repeat(group_size, axis=1)[:, :num_in]
    q = np.clip(np.round(w / s) + zero.repeat(group_size, axis=1)[:, :num_in], 0, max_q)
    return q.astype(np.uint8), scale, zero


def pack_along_first(values: np.ndarray, bits: int) -> np.ndarray:
    """u[n, m] -> i32[n * bits / 32, m]: element k of each word at bits k * bits."""
    per_word = 32 // bits
    v = values.astype(np.uint32).reshape(-1, per_word, values.shape[1])
    words = np.zeros((v.shape[0], values.shape[1]), np.uint32)
    for k in range(per_word):
        words |= v[:, k] << np.uint32(k * bits)
    return words.view(np.int32)


def _gptq(state, bits: int = 4, group_size: int = 32, sym: bool = True, desc_act: bool = False):
    rng = np.random.default_rng(0)
    out, reference = dict(state), {}
    max_q = (1 << bits) - 1
    for name in linear_names(state):
        module = name[: -len(".weight")]
        w = state[name].float().numpy()
        num_in = w.shape[1]
        g = group_size if group_size > 0 else num_in
        g_idx = np.arange(num_in) // g
        if desc_act:  # act-order: the columns' groups follow a permutation of them
            perm = _shared_permutation(module, num_in, rng)
            g_idx = np.empty(num_in, np.int64)
            g_idx[perm] = np.arange(num_in) // g
        # Quantize the columns in their act order, as GPTQ does.
        order = np.argsort(g_idx, kind="stable")
        q_sorted, scale, zero = _min_max_groups(w[:, order], bits, g, sym)
        q = np.empty_like(q_sorted)
        q[:, order] = q_sorted
        stored_zero = (zero - 1) & max_q  # v1 stores zero points minus one
        del out[name]
        out[f"{module}.qweight"] = torch.from_numpy(pack_along_first(q.T, bits))
        out[f"{module}.qzeros"] = torch.from_numpy(pack_along_first(stored_zero, bits).T.copy())
        out[f"{module}.scales"] = torch.from_numpy(scale.T.copy())
        out[f"{module}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        # GPTQModel's torch dequantization: scales[g_idx] * (q - (qzeros + 1)[g_idx]).
        s = torch.from_numpy(scale.T.copy())[torch.from_numpy(g_idx)]  # [I, O] f16
        z = torch.from_numpy(stored_zero.T.copy() + 1)[torch.from_numpy(g_idx)]  # [I, O]
        reference[name] = (s * (torch.from_numpy(q.T.astype(np.int32)) - z)).T.float()
    qconfig = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq",
    }
    return out, reference, qconfig


_PERMUTATIONS: dict[tuple[str, int], np.ndarray] = {}


def _shared_permutation(module: str, num_in: int, rng) -> np.ndarray:
    """One act-order permutation per input: q/k/v (and gate/up) read the same activations,
    whose Hessian GPTQ orders them by, so they share it."""
    key = (re.sub(r"(q|k|v|gate|up)_proj$|w[13]$", "in", module), num_in)
    if key not in _PERMUTATIONS:
        _PERMUTATIONS[key] = rng.permutation(num_in)
    return _PERMUTATIONS[key]


_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_awq(values: np.ndarray) -> np.ndarray:
    """u4[n, m] -> i32[n, m / 8]: word c holds columns 8c + _AWQ_ORDER[k] at bits 4k."""
    v = values.astype(np.uint32).reshape(values.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], np.uint32)
    for k, column in enumerate(_AWQ_ORDER):
        words |= v[:, :, column] << np.uint32(4 * k)
    return words.view(np.int32)


def _awq(state, group_size: int = 32):
    out, reference = dict(state), {}
    for name in linear_names(state):
        module = name[: -len(".weight")]
        q, scale, zero = _min_max_groups(state[name].float().numpy(), 4, group_size, False)
        del out[name]
        out[f"{module}.qweight"] = torch.from_numpy(_pack_awq(q.T))  # [I, O / 8]
        out[f"{module}.qzeros"] = torch.from_numpy(_pack_awq(zero.T))  # [G, O / 8]
        out[f"{module}.scales"] = torch.from_numpy(scale.T.copy())  # [G, O]
        # AutoAWQ's dequantization: (iweight - izeros) * scales, in float16.
        s = torch.from_numpy(scale).repeat_interleave(group_size, dim=1)  # [O, I] f16
        z = torch.from_numpy(zero).repeat_interleave(group_size, dim=1)
        reference[name] = ((torch.from_numpy(q.astype(np.int32)) - z) * s).float()
    qconfig = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return out, reference, qconfig


# FP8 with weight_block_size -----------------------------------------------------------------


def _fp8_blocks(state, block: tuple[int, int] = (128, 128)):
    out, reference = dict(state), {}
    bo, bi = block
    for name in linear_names(state):
        module = name[: -len(".weight")]
        w = state[name].float()
        rows, cols = math.ceil(w.shape[0] / bo), math.ceil(w.shape[1] / bi)
        padded = torch.nn.functional.pad(w, (0, cols * bi - w.shape[1], 0, rows * bo - w.shape[0]))
        amax = padded.reshape(rows, bo, cols, bi).abs().amax((1, 3)).clamp(min=1e-12)
        scale_inv = amax / 448.0  # [rows, cols] f32
        full = scale_inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[
            : w.shape[0], : w.shape[1]
        ]
        values = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[f"{module}.weight"] = values
        out[f"{module}.weight_scale_inv"] = scale_inv
        reference[name] = values.float() * full
    qconfig = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    return out, reference, qconfig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a float HF model directory")
    parser.add_argument("dst", help="where the quantized checkpoint is written")
    parser.add_argument("--format", choices=("compressed-tensors", "gptq", "awq", "fp8"))
    parser.add_argument("--scheme", default="W4A16", help="compressed-tensors' preset scheme")
    parser.add_argument("--bits", type=int, default=4, help="GPTQ's bits")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args(argv)
    options = {
        "compressed-tensors": {"scheme": args.scheme, "group_size": args.group_size},
        "gptq": {"bits": args.bits, "group_size": args.group_size},
        "awq": {"group_size": args.group_size},
        "fp8": {},
    }[args.format]
    quantize_checkpoint(args.src, args.dst, args.format, **options)
    print(f"wrote {args.dst} ({args.format} {options})")


if __name__ == "__main__":
    main()
