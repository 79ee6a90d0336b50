"""Checkpoints of a bare base model, as embedding repositories ship them (Qwen3-Embedding,
gte-Qwen2, e5-mistral): HF's `*Model` saved alone, so its tensors lack the causal LM's wrapper
prefix (`layers.0.` where the causal LM saves `model.layers.0.`) and there is no LM head.

Such a model loads as its causal LM's family (models/registry.py's BASE_MODELS). Without an LM
head it can only pool: as in vLLM, a generating engine refuses it unless its embeddings are
tied (then the embedding matrix is the head, as in the causal LM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable

from jvllm.config import ModelConfig

# The LM head's tensor as the families' checkpoints name it (GPT-NeoX's embed_out; a
# multimodal checkpoint's language_model.lm_head).
_HEAD_SUFFIXES = ("lm_head.weight", "embed_out.weight")


def stored_name(name: str, names: Container[str]) -> str:
    """`name` as the checkpoint stores it: as the family names it, or without its first
    component where the checkpoint holds the base model alone (`model.`, GPT-2's
    `transformer.`). `name` itself where neither is stored, so the error names it."""
    if name in names:
        return name
    base = name.partition(".")[2]
    return base if base in names else name


def without_missing_head(config: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """`config` with has_lm_head=False where it has untied embeddings and the checkpoint has no
    LM head (a base model), else `config` itself."""
    if config.tie_word_embeddings or any(n.endswith(_HEAD_SUFFIXES) for n in names):
        return config
    return dataclasses.replace(config, tie_word_embeddings=True, has_lm_head=False)
