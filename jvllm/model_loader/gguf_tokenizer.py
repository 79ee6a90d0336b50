"""A GGUF file's tokenizer, built with `tokenizers` alone.

transformers can read a GGUF tokenizer too, but its GGUF support imports torch, which inference
does not otherwise need. This builds the same fast tokenizer (checked against transformers' in
the tests) from the file's `tokenizer.*` metadata, for llama.cpp's two tokenizer models
(checked on Llama, Qwen2 and SmolLM2 files; gguf_arch.py's other architectures use them too):
- "gpt2": byte-level BPE with the file's merges, its text split as `tokenizer.ggml.pre` says
  (Llama 3's or Qwen2's pattern, else GPT-2's);
- "llama": SentencePiece BPE (Llama 2, Mistral, TinyLlama), whose merges the file does not
  list: they follow from the vocabulary and each token's score.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from transformers import PreTrainedTokenizerFast

from jvllm.logger import init_logger
from jvllm.model_loader.gguf_file import GGUFFile, read_gguf

logger = init_logger(__name__)

_CONTROL = 3  # llama.cpp token type of special tokens (<|im_start|>, ...)
SUPPORTED_TOKENIZERS = ("gpt2", "llama")
# How Llama 3's tokenizer splits text before its merges (llama.cpp names it "llama-bpe"; older
# conversions "llama3" or "llama-v3"): case-insensitive contractions, a word with the one
# non-letter before it, numbers in runs of up to three digits.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's is the same but for digits, one at a time; its own tokenizer also composes Unicode
# (NFC) first.
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),
}
# Pre-tokenizer names whose split is GPT-2's own (SmolLM2's is "smollm").
_GPT2_PRES = (None, "default", "gpt-2", "gpt2", "smollm")
_SPIECE_SPACE = "\u2581"


def tokenizer_from_gguf(path: str, gguf: GGUFFile | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer of the GGUF at `path` (`gguf`: the file already read)."""
    meta = (gguf or read_gguf(path)).metadata.get
    kind = meta("tokenizer.ggml.model")
    tokens: list[str] = meta("tokenizer.ggml.tokens")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, meta("tokenizer.ggml.merges", []), meta)
        add_bos = meta("tokenizer.ggml.add_bos_token", False)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(tokens, meta("tokenizer.ggml.scores"), meta)
        add_bos = meta("tokenizer.ggml.add_bos_token", True)  # llama.cpp's default for it
    else:
        raise ValueError(
            f"{path}: GGUF tokenizer {kind!r} is not supported; supported: {SUPPORTED_TOKENIZERS}"
        )
    types = meta("tokenizer.ggml.token_type", [])
    special = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])

    def token(key: str) -> str | None:
        index = meta(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_eos = meta("tokenizer.ggml.add_eos_token", False)
    tokenizer.post_processor = _template(tokens, bos if add_bos else None, eos if add_eos else None)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta("tokenizer.chat_template"),
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], meta) -> Tokenizer:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    pre = meta("tokenizer.ggml.pre")
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:  # GPT-2's own split
        if pre not in _GPT2_PRES:
            logger.warning(
                "GGUF tokenizer pre-tokenizer %r has no split of its own here; GPT-2's is used, "
                "so some texts may tokenize unlike the model's own tokenizer (known: %s). "
                "Pass tokenizer= a directory with the model's tokenizer files to be exact",
                pre,
                ", ".join(sorted(_SPLITS)),
            )
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(tokens: list[str], scores: list[float], meta) -> Tokenizer:
    """SentencePiece's BPE as a `tokenizers` BPE: spaces as "▁" (one before the text), bytes
    missing from the vocabulary as its <0xNN> tokens, and as merges every split of a token into
    two tokens, the best-scored tokens' first (SentencePiece merges the pair whose token scores
    highest)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merged, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = meta("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=vocab,
        merges=[(left, right) for *_, left, right in merges],
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    prefix = meta("tokenizer.ggml.add_space_prefix", True)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _template(tokens: list[str], bos: str | None, eos: str | None) -> Any:
    """The post-processor that adds BOS before and EOS after a text, where the file says to."""
    single = [x for x in (bos, "$A", eos) if x]
    second = [x for x in (bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x]
    specials = [(t, tokens.index(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(single + second), special_tokens=specials
    )
