"""Load a llama.cpp GGUF file (gguf_arch.py's architectures): packed, or dequantized to float32.

The GGUF is first turned into what an HF checkpoint would hold (a config dict and HF-named
torch-layout tensors, each dequantized when read), so the fusion into our layout is shared with
`hf.py`, and the default model's on-disk cache can be an ordinary HF directory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from jvllm.config import ModelConfig
from jvllm.distributed.expert_parallel import expert_parallel_config
from jvllm.distributed.mesh import num_ranks, num_shards
from jvllm.distributed.tensor_parallel import placer
from jvllm.model_loader.dequantize import dequantize
from jvllm.model_loader.gguf_arch import GLOBAL_NAMES, architecture_of, hf_config_of
from jvllm.model_loader.gguf_file import GGUFFile, GGUFTensor, read_gguf
from jvllm.model_loader.hf import HFOverrides, apply_hf_overrides, resolve_dtype
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.models.model import load_checkpoint_weights
from jvllm.quantization.gguf_blocks import BLOCK_FORMATS, PACKED_QTYPES

_FLOAT_QTYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF checkpoint, dequantized from its GGUF tensor when read."""

    source: GGUFTensor
    # q and k: llama.cpp's converter reorders each head's H rows from HF's rotate-half layout
    # (pairs (j, j + H/2)) to interleaved pairs (2j, 2j + 1); we rotate halves, so reading puts
    # the rows back: within a head, GGUF row 2j + s is HF row s * H/2 + j.
    num_rope_heads: int | None = None
    # Added to the values when read: -1 for Gemma's norms, which llama.cpp's converter stores
    # as HF's weight + 1. Only float tensors are shifted, so blocks() never needs it.
    shift: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.source.qtype

    def blocks(self) -> np.ndarray:
        """The encoded blocks [O, nb] (a structured array of the block format's fields), rows
        in HF's order: a block never spans two rows, so reordering rows moves whole blocks."""
        src = self.source
        blocks = src.data.view(BLOCK_FORMATS[src.qtype].fields).reshape(src.shape[0], -1)
        if self.num_rope_heads is None:
            return blocks
        out_dim = self.shape[0]
        gguf_order = blocks.reshape(self.num_rope_heads, out_dim // self.num_rope_heads // 2, 2, -1)
        return gguf_order.swapaxes(1, 2).reshape(out_dim, -1)  # a copy, in HF's order

    def read(self, out: np.ndarray | None = None) -> np.ndarray:
        """-> f32[shape] in HF's layout, written into `out` when given."""
        out = np.empty(self.shape, np.float32) if out is None else out
        src = self.source
        if self.num_rope_heads is None:
            dequantize(src.data, src.qtype, src.shape, out)
            if self.shift:
                out += self.shift
            return out
        out_dim, in_dim = self.shape
        gguf_order = (self.num_rope_heads, out_dim // self.num_rope_heads // 2, 2, in_dim)
        hf_rows = out.reshape(self.num_rope_heads, 2, -1, in_dim).swapaxes(1, 2)  # GGUF's order
        dequantize(src.data, src.qtype, gguf_order, hf_rows)
        return out


def gguf_as_hf(gguf: GGUFFile, path: str) -> tuple[dict[str, Any], dict[str, HFTensor]]:
    """-> (HF config.json dict, {HF tensor name: its GGUF tensor, to read as float32})."""
    arch, spec = architecture_of(gguf, path)
    hf_config = hf_config_of(gguf, path)
    num_heads = {"attn_q.weight": hf_config["num_attention_heads"]}
    num_heads["attn_k.weight"] = hf_config["num_key_value_heads"]
    tensors: dict[str, HFTensor] = {}
    for name, t in gguf.tensors.items():
        layer, rest = name.split(".", 2)[1:] if name.startswith("blk.") else (None, name)
        experts = _experts_of(t, rest, spec.expert_names) if layer is not None else {}
        if experts:
            tensors.update({f"model.layers.{layer}.{n}": HFTensor(e) for n, e in experts.items()})
            continue
        if layer is not None and rest in spec.layer_names:
            hf_name = f"model.layers.{layer}.{spec.layer_names[rest]}"
        elif layer is None and name in GLOBAL_NAMES:
            hf_name = GLOBAL_NAMES[name]
        elif layer is None and name in spec.config_tensors:
            continue
        else:
            raise ValueError(f"{path}: unexpected GGUF tensor {name!r} in a {arch!r} file")
        rope_heads = num_heads.get(rest) if spec.permutes_qk else None
        shift = spec.norm_shift if rest.endswith("norm.weight") else 0.0
        if shift and t.qtype not in _FLOAT_QTYPES:
            raise ValueError(
                f"{path}: norm {name!r} is {t.qtype.name}; supported: "
                f"{[q.name for q in _FLOAT_QTYPES]} (llama.cpp keeps norms in floats)"
            )
        tensors[hf_name] = HFTensor(t, rope_heads, shift)
    return hf_config, tensors


def _experts_of(t: GGUFTensor, rest: str, expert_names) -> dict[str, GGUFTensor]:
    """A layer's expert tensor (`rest` after "blk.{i}.") as HF's per-expert tensors {name after
    "model.layers.{i}.": [out, in]}, or {} if it is none: llama.cpp's 3-D ffn_*_exps
    [E, out, in], each expert a view of its own contiguous blocks, or an old Mixtral file's
    ffn_*.{j}, expert j's alone."""
    if rest in expert_names:
        num_experts, size = t.shape[0], t.data.size // t.shape[0]
        return {
            expert_names[rest].format(j): GGUFTensor(
                f"{t.name}[{j}]", t.qtype, t.shape[1:], t.data[j * size : (j + 1) * size]
            )
            for j in range(num_experts)
        }
    kind, index, suffix = (rest.split(".") + ["", ""])[:3]
    merged = f"{kind}_exps.{suffix}"
    if not index.isdigit() or merged not in expert_names:
        return {}
    return {expert_names[merged].format(index): t}


# What quantization="gguf" loads: block formats kept packed, and float tensors (norms).
_KEPT_QTYPES = (*PACKED_QTYPES, *_FLOAT_QTYPES)


def _check_packable(tensors: dict[str, HFTensor], path: str) -> None:
    """Every tensor is of a block format kept packed, or a float one; but the experts, which
    are dequantized at load whatever their format (the packed kernels take 2-D matmul weights
    only; CheckpointWeights.stacked_experts reads floats)."""
    unsupported = {
        t.source.name: t.qtype.name
        for name, t in tensors.items()
        if t.qtype not in _KEPT_QTYPES and ".experts." not in name
    }
    if unsupported:
        name, qtype = next(iter(unsupported.items()))
        raise ValueError(
            f"{path}: tensor {name!r} is {qtype} ({len(unsupported)} tensors of types "
            f"{sorted(set(unsupported.values()))}), which quantization='gguf' does not keep "
            f"packed; supported: {[q.name for q in _KEPT_QTYPES]}. Pass dtype='float32' or "
            "'bfloat16' to dequantize the file at load instead."
        )


def load_gguf(
    path: str,
    dtype: str = "auto",
    mesh=None,
    keep_packed: bool = False,
    hf_overrides: HFOverrides = None,
    enable_expert_parallel: bool = False,
) -> tuple[ModelConfig, dict]:
    """Load a GGUF, fused into our layout; dtype "auto" means float32 here. Placed on
    `mesh` (None: JAX's default device). hf_overrides apply to the HF config its metadata
    gives (hf.apply_hf_overrides); enable_expert_parallel places the routed experts whole over
    the mesh (distributed/expert_parallel.py).

    keep_packed: tensors of a block format that stays packed (quantization/gguf_blocks.py)
    become GGUFWeights of their blocks, dequantized inside the step; otherwise (and for other
    formats, and for a MoE file's experts in any format) every tensor is dequantized to float32
    here and cast to the model dtype."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    hf_config, tensors = gguf_as_hf(read_gguf(path), path)
    hf_config = apply_hf_overrides(hf_config, hf_overrides)
    config = model_config_from_hf(hf_config, resolve_dtype(dtype, hf_config))
    config = expert_parallel_config(
        config, num_shards(mesh), enable_expert_parallel, num_ranks(mesh)
    )
    if keep_packed:
        _check_packable(tensors, path)
        # Under tensor parallelism each device gets its share of the blocks (place_blocks).
        place = placer(config, mesh)
        return config, load_checkpoint_weights(config, tensors.__getitem__, place, keep_packed=True)
    get = lambda name: tensors[name].read()
    return config, load_checkpoint_weights(config, get, placer(config, mesh))
