"""A GGUF file's byte-level BPE tokenizer, built with `tokenizers` alone.

transformers can read a GGUF tokenizer too, but its GGUF support imports torch, which inference
does not otherwise need. This builds the same fast tokenizer (checked against transformers' in
the tests) from the file's `tokenizer.*` metadata.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from jvllm.model_loader.gguf_file import GGUFFile, read_gguf

_CONTROL = 3  # llama.cpp token type of special tokens (<|im_start|>, ...)


def tokenizer_from_gguf(path: str, gguf: GGUFFile | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer of the GGUF at `path` (`gguf`: the file already read)."""
    meta = (gguf or read_gguf(path)).metadata.get

    kind = meta("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: GGUF tokenizer {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    tokens: list[str] = meta("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    types = meta("tokenizer.ggml.token_type", [])
    special = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])

    def token(key: str) -> str | None:
        index = meta(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta("tokenizer.chat_template"),
    )
