"""Quantized weights: GGUF blocks kept packed on the device (gguf_blocks.py, packed_weight.py),
int8 / fp8 weights with per-channel scales made at load (channel_weight.py; a MoE's routed
experts, expert_weight.py), and pre-quantized checkpoints' weights (int4 / int8 groups,
int_weight.py; FP8 blocks, fp8_weight.py), chosen at load (model_loader/loader.py) and
dequantized inside the jitted step; and the float matmul they all end in (dot.py, with its CPU
kernel cpu_dense.py), which the layers call for unquantized weights."""

import jax
from gguf.constants import GGMLQuantizationType as Q

from jvllm.quantization import cpu_dense, cpu_gguf, cpu_int8, cpu_int_group
from jvllm.quantization.channel_weight import ChannelWeight
from jvllm.quantization.expert_weight import ExpertWeight
from jvllm.quantization.fp8_weight import FP8Weight
from jvllm.quantization.int_weight import IntWeight
from jvllm.quantization.mixed_weight import MixedGGUFWeight
from jvllm.quantization.packed_weight import GGUFWeight

# The quant_method of the pre-quantized checkpoints jvllm reads (model_loader/quant_config.py),
# and vLLM's other names for them (its Marlin kernels' names load the same checkpoints).
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
METHOD_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# vLLM's `quantization=` names that jvllm accepts: GGUF, online int8 / fp8 ("fp8" also names
# FP8 checkpoints), and the pre-quantized checkpoints' methods.
QUANTIZATION_METHODS = ("gguf", "int8", "fp8", *CHECKPOINT_METHODS[:-1], *METHOD_ALIASES)
QuantizedWeight = (
    GGUFWeight | MixedGGUFWeight | ChannelWeight | ExpertWeight | IntWeight | FP8Weight
)


def build_kernels_early(quantization: str | None, dtype: str, prequantized: bool = False) -> None:
    """Start building, in the background, the native CPU matmul kernels that a model loaded
    with `quantization` (as the loader resolves it) in model dtype `dtype` multiplies its
    weights with, so that they build while it loads: a packed GGUF's kernel, not the float
    one, which packed weights never reach (on 2 cores the two builds would share them before
    the first token; a float matrix a GGUF holds gets its kernel built when the step is
    traced); int8's, or for a `prequantized` checkpoint (GPTQ, AWQ, compressed-tensors, FP8)
    the grouped one of its integer groups and FP8 blocks, beside the float one (for the layers
    left in the model dtype); else the float one."""
    if quantization == "gguf":
        cpu_gguf.build_early(dtype)
        return
    if quantization == "int8":
        cpu_int8.build_early(dtype)
    if prequantized:
        cpu_int_group.build_early(dtype)
    cpu_dense.build_early(dtype)


def is_quantized(x) -> bool:
    """Whether a params leaf is a quantized weight (one param, however many arrays)."""
    return isinstance(x, QuantizedWeight)


def describe_weights(params, dtype: str) -> str:
    """For the start-up log: the model dtype, the quantized formats held, and the bytes of
    weights resident, e.g. "float32; GGUF Q4_1+Q8_0 packed; 92.1 MiB of weights"."""
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    num_bytes = sum(x.nbytes for x in leaves)
    qtypes = {x.qtype for x in leaves if isinstance(x, GGUFWeight)}
    qtypes = qtypes.union(*(x.qtypes for x in leaves if isinstance(x, MixedGGUFWeight)))
    gguf = sorted(Q(q).name for q in qtypes)
    per_channel = (ChannelWeight, ExpertWeight)
    channel = sorted({x.values.dtype.name for x in leaves if isinstance(x, per_channel)})
    groups = sorted(
        {f"int{x.bits} groups of {x.group_size}" for x in leaves if isinstance(x, IntWeight)}
    )
    fp8 = sorted(
        {f"fp8 blocks {x.block[0]}x{x.block[1]}" for x in leaves if isinstance(x, FP8Weight)}
    )
    formats = []
    if gguf:
        formats.append(f"GGUF {'+'.join(gguf)} packed")
    if channel:
        formats.append(f"{'+'.join(channel)} per-channel")
    formats.extend(groups + fp8)
    return "; ".join([dtype, *formats, f"{num_bytes / 2**20:.1f} MiB of weights"])
