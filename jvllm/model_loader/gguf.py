"""Load a llama.cpp GGUF file (Llama or Qwen2 architecture): packed, or dequantized to float32.

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
from jvllm.distributed.tensor_parallel import placer
from jvllm.model_loader.dequantize import dequantize
from jvllm.model_loader.gguf_file import GGUFFile, GGUFTensor, read_gguf
from jvllm.model_loader.hf import HFOverrides, apply_hf_overrides, resolve_dtype
from jvllm.models.model import load_checkpoint_weights
from jvllm.quantization.gguf_blocks import BLOCK_FORMATS, PACKED_QTYPES

# GGUF per-layer tensor names -> HF names (after "blk.{i}." / "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2's
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# GGUF architecture -> HF's architecture and model_type (the GGUF's keys are prefixed with it).
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF checkpoint, dequantized from its GGUF tensor when read."""

    source: GGUFTensor
    # q and k: llama.cpp's converter reorders each head's H rows from HF's rotate-half layout
    # (pairs (j, j + H/2)) to interleaved pairs (2j, 2j + 1); we rotate halves, so reading puts
    # the rows back: within a head, GGUF row 2j + s is HF row s * H/2 + j.
    num_rope_heads: int | None = None

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
            return dequantize(src.data, src.qtype, src.shape, out)
        out_dim, in_dim = self.shape
        gguf_order = (self.num_rope_heads, out_dim // self.num_rope_heads // 2, 2, in_dim)
        hf_rows = out.reshape(self.num_rope_heads, 2, -1, in_dim).swapaxes(1, 2)  # GGUF's order
        dequantize(src.data, src.qtype, gguf_order, hf_rows)
        return out


def gguf_as_hf(gguf: GGUFFile, path: str) -> tuple[dict[str, Any], dict[str, HFTensor]]:
    """-> (HF config.json dict, {HF tensor name: its GGUF tensor, to read as float32})."""
    arch = gguf.metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{list(_ARCHITECTURES)}"
        )

    meta = gguf.metadata.get
    num_heads = meta(f"{arch}.attention.head_count")
    num_kv_heads = meta(f"{arch}.attention.head_count_kv", num_heads)
    hidden_size = meta(f"{arch}.embedding_length")
    hf_architecture, model_type = _ARCHITECTURES[arch]
    hf_config = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": meta(f"{arch}.vocab_size") or len(meta("tokenizer.ggml.tokens")),
        "hidden_size": hidden_size,
        "intermediate_size": meta(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": meta(f"{arch}.attention.key_length", hidden_size // num_heads),
        "rms_norm_eps": meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta(f"{arch}.context_length", 2048),
        # llama.cpp drops output.weight when the head is tied to the embedding.
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "dtype": "float32",
    }
    if meta(f"{arch}.rope.dimension_count", hf_config["head_dim"]) != hf_config["head_dim"]:
        raise ValueError(
            f"{path}: GGUF rope over {meta(f'{arch}.rope.dimension_count')} of each head's "
            f"{hf_config['head_dim']} dims is not supported; supported: rope over the whole head"
        )
    scaling = meta(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(meta(f"{arch}.rope.scaling.factor", 1.0))
        hf_config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling != "none":
        raise ValueError(
            f"{path}: GGUF rope scaling {scaling!r} is not supported; supported: 'none', "
            "'linear', and Llama 3.1's frequency factors (rope_freqs.weight)"
        )
    if "rope_freqs.weight" in gguf.tensors:
        hf_config["rope_scaling"] = _rope_factors(gguf.tensors["rope_freqs.weight"], hf_config)

    tensors: dict[str, HFTensor] = {}
    for name, t in gguf.tensors.items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ValueError(f"{path}: unexpected GGUF tensor {name!r}")
            # llama.cpp's converter reorders q and k for its Llama rope, not for Qwen2's.
            permuted = {"attn_q.weight": num_heads, "attn_k.weight": num_kv_heads}
            rope_heads = permuted.get(rest) if arch == "llama" else None
            tensors[f"model.layers.{layer}.{_LAYER_NAMES[rest]}"] = HFTensor(t, rope_heads)
        elif name in _GLOBAL_NAMES:
            tensors[_GLOBAL_NAMES[name]] = HFTensor(t)
        elif name != "rope_freqs.weight":  # in the config
            raise ValueError(f"{path}: unexpected GGUF tensor {name!r}")
    return hf_config, tensors


def _rope_factors(tensor: GGUFTensor, hf_config: dict[str, Any]) -> dict[str, Any]:
    """HF's rope_scaling for llama.cpp's rope_freqs f32[H/2]: one divisor of each rotation
    frequency, as its converter writes Llama 3.1's scaling (Llama 3.1-3.3 files). Those are
    longrope's divisors with a single set and no cos/sin scale."""
    factors = dequantize(tensor.data, tensor.qtype, tensor.shape).reshape(-1)
    if factors.shape[0] != hf_config["head_dim"] // 2 or not np.all(factors > 0):
        raise ValueError(
            f"rope_freqs.weight must hold head_dim / 2 = {hf_config['head_dim'] // 2} positive "
            f"divisors, got {factors.shape[0]} values (min {factors.min()})"
        )
    divisors = [float(f) for f in factors]
    return {
        "rope_type": "longrope",
        "short_factor": divisors,
        "long_factor": divisors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": hf_config["max_position_embeddings"],
    }


# What quantization="gguf" loads: block formats kept packed, and float tensors (norms).
_KEPT_QTYPES = (
    *PACKED_QTYPES,
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
)


def _check_packable(tensors: dict[str, HFTensor], path: str) -> None:
    """Every tensor is of a block format kept packed, or a float one."""
    unsupported = {
        t.source.name: t.qtype.name for t in tensors.values() if t.qtype not in _KEPT_QTYPES
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
) -> tuple[ModelConfig, dict]:
    """Load a Llama GGUF, fused into our layout; dtype "auto" means float32 here. Placed on
    `mesh` (None: JAX's default device). hf_overrides apply to the HF config its metadata
    gives (hf.apply_hf_overrides).

    keep_packed: tensors of a block format that stays packed (quantization/gguf_blocks.py)
    become GGUFWeights of their blocks, dequantized inside the step; otherwise (and for other
    formats) every tensor is dequantized to float32 here and cast to the model dtype."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    hf_config, tensors = gguf_as_hf(read_gguf(path), path)
    hf_config = apply_hf_overrides(hf_config, hf_overrides)
    config = ModelConfig.from_hf_config(hf_config, resolve_dtype(dtype, hf_config))
    if keep_packed and mesh is not None and mesh.size > 1:
        raise ValueError(
            "quantization='gguf' keeps weights packed on one device; tensor parallelism over "
            f"{mesh.size} devices needs them dequantized: pass dtype='float32' or 'bfloat16' "
            "and no quantization"
        )
    if keep_packed:
        _check_packable(tensors, path)
        return config, load_checkpoint_weights(config, tensors.__getitem__, keep_packed=True)
    get = lambda name: tensors[name].read()
    return config, load_checkpoint_weights(config, get, placer(config, mesh))
