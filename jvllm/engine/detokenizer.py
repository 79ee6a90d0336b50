"""Incremental detokenization: turn one new token at a time into new text.

Decoding a token alone is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (a token's leading space depends on its left neighbour). So each step decodes a short
window of the previous tokens with and without the new ones, and emits the difference once it no
longer ends in an incomplete character.

A prompt can end inside a character (byte-level BPE splits one across tokens). Its decoded text
then ends in U+FFFD, and the output text starts where that character starts: the first output
token that completes it emits the whole character, so that the prompt's text without its
incomplete end, followed by the output text, is the decoded text of prompt and output together.
"""

_INITIAL_CONTEXT = 5  # prompt tokens kept as left context for the first output token


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._spaces_between_special = spaces_between_special_tokens
        self.token_ids = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self._prefix_offset = 0  # start of the window of context tokens
        self._read_offset = len(self.token_ids)  # tokens before this are already in `text`
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special,
            spaces_between_special_tokens=self._spaces_between_special,
        )

    def add_token(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        if not self.text:  # the prefix is the prompt's end: its incomplete character is output's
            prefix = prefix.rstrip("\ufffd")
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing printable yet, or a multi-byte character is still incomplete
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
