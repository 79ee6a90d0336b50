"""Host side of logprobs: the runner's top-k arrays -> vLLM's {token_id: Logprob} dicts."""

import numpy as np

from jvllm.outputs import Logprob


class TokenDecoder:
    """Each token's text alone (vLLM's `decoded_token`), cached: the same ids recur a lot."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self._tokenizer is None:
            return None
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def logprobs_entry(
    num_logprobs: int,
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
    token_id: int,
    token_logprob: float,
    token_rank: int,
    decode,
) -> dict[int, Logprob]:
    """The chosen token first, then the `num_logprobs` most likely (ranks 1..k), as in vLLM."""
    entry = {token_id: Logprob(float(token_logprob), int(token_rank), decode(token_id))}
    for rank, (tid, lp) in enumerate(zip(top_ids[:num_logprobs], top_logprobs[:num_logprobs])):
        tid = int(tid)
        if tid not in entry:
            entry[tid] = Logprob(float(lp), rank + 1, decode(tid))
    return entry
