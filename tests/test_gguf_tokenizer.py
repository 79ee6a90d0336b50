"""Our torch-free GGUF tokenizers (model_loader/gguf_tokenizer.py) against transformers' reading
of the same files: Llama 3's and Qwen2's byte-level BPE (their own splits) and a SentencePiece
vocabulary as Llama 2 and Mistral files hold it. The default model's is in test_smollm2.py."""

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import rewrite_gguf
from gguf import GGUFWriter
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from jvllm.model_loader import gguf_tokenizer
from jvllm.model_loader.default_model import resolve_default_model
from jvllm.model_loader.gguf_tokenizer import tokenizer_from_gguf

_TEXT = Path(__file__).parents[1] / "jvllm" / "benchmarks" / "data" / "pride_and_prejudice.txt"
_TEXTS = [
    "Hello world",
    "The year 2050 has 12345 days!",
    "I'M here, you're THERE; they'LL see.",
    "  spaces   and\ttabs\n\nnewlines\n",
    "ünïcödé 日本語 🙂 (x+y)*2 == 42?!",
    "It is a truth universally acknowledged, that a single man in possession",
    "def f(x):\n    return x**2  # square",
]


def _same_as_transformers(path: str, texts=_TEXTS) -> None:
    ours = tokenizer_from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        ), text


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_a_llama3_or_qwen2_pre_tokenizer_splits_as_theirs_and_adds_bos(tmp_path, pre):
    """The default model's vocabulary under Llama 3's (or Qwen2's) split, BOS added as Llama
    3's files ask."""
    path = str(tmp_path / f"{pre}-split.gguf")
    metadata = {"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": True}
    rewrite_gguf(resolve_default_model(), path, metadata=metadata)
    _same_as_transformers(path)
    ours = tokenizer_from_gguf(path)
    assert ours.encode("hi")[0] == ours.bos_token_id
    gpt2_split = tokenizer_from_gguf(resolve_default_model())
    assert any(ours.encode(t)[1:] != gpt2_split.encode(t) for t in _TEXTS)  # the split matters


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> str:
    """A SentencePiece BPE vocabulary of 600 tokens learned from the shipped text, written as
    llama.cpp writes Llama 2's: <unk>, <s>, </s>, the 256 byte tokens, then the pieces with
    falling scores (no merges: they follow from the scores)."""
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(_TEXT.read_text().splitlines(), trainer)
    learned = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    pieces = [t for t, _ in learned if t not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]

    path = str(tmp_path_factory.mktemp("spm") / "spm.gguf")
    writer = GGUFWriter(path, arch="llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_uint32("llama.embedding_length", 32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_reads_it(sentencepiece_gguf):
    _same_as_transformers(sentencepiece_gguf)
    ours = tokenizer_from_gguf(sentencepiece_gguf)
    ids = ours.encode("It is a truth")
    assert ids[0] == 1 and ours.convert_ids_to_tokens(ids[1]).startswith("\u2581")
    assert len(ids) < len("It is a truth")  # pieces were merged
    assert "<0xF0>" in ours.convert_ids_to_tokens(ours.encode("🙂"))  # bytes fall back


def test_an_unknown_tokenizer_model_is_a_clear_error(tmp_path):
    path = str(tmp_path / "t5.gguf")
    rewrite_gguf(resolve_default_model(), path, metadata={"tokenizer.ggml.model": "t5"})
    with pytest.raises(ValueError, match=r"tokenizer 't5' is not supported; supported: \('gpt2'"):
        tokenizer_from_gguf(path)


def test_a_pre_tokenizer_without_a_split_here_says_so(tmp_path, monkeypatch):
    records = []  # jvllm's loggers do not propagate to the root
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(logging.getLogger(gguf_tokenizer.__name__), "handlers", [handler])
    path = str(tmp_path / "tekken.gguf")
    rewrite_gguf(resolve_default_model(), path, metadata={"tokenizer.ggml.pre": "tekken"})
    tokenizer_from_gguf(path)
    assert [
        "pre-tokenizer 'tekken' has no split of its own here" in r.getMessage() for r in records
    ] == [True]
    tokenizer_from_gguf(resolve_default_model())  # "smollm": GPT-2's split, as it should be
    assert len(records) == 1
