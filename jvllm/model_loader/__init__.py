"""Model loading: HF directories, GGUF files and the default model."""

from jvllm.model_loader.default_model import DEFAULT_MODEL, resolve_default_model
from jvllm.model_loader.gguf import load_gguf
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.loader import load_model

__all__ = ["DEFAULT_MODEL", "load_gguf", "load_hf_dir", "load_model", "resolve_default_model"]
