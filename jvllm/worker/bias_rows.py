"""One additive logit row per request that needs one, kept on device between steps.

`logit_bias`, `allowed_token_ids`, `bad_words` and `min_tokens` all become additions to the
logits (a bias, or -inf for a banned token), so each such request owns a row of
`rows: f32[R, V]`; the step adds `rows[bias_slot]`. Row 0 stays zero for everyone else. A row is
re-sent only when it changes (min_tokens reached, a bad word's prefix just generated).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.core.request import Request, RequestStatus
from jvllm.core.token_bans import next_token_bans


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space, as vLLM tokenizes them."""
    sequences: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        # The spaced form counts only when it is a different token sequence of the same length.
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return [s for s in sequences if s]


def needs_row(request: Request) -> bool:
    params = request.sampling_params
    return bool(
        params.logit_bias
        or params.allowed_token_ids is not None
        or request.bad_words_token_ids
        or params.min_tokens > 0
    )


def _static_row(request: Request, vocab_size: int) -> np.ndarray:
    params = request.sampling_params
    row = np.zeros(vocab_size, np.float32)
    if params.allowed_token_ids is not None:
        row[:] = -np.inf
        row[params.allowed_token_ids] = 0.0
    for token_id, bias in (params.logit_bias or {}).items():
        row[token_id] += bias
    for sequence in request.bad_words_token_ids:
        if len(sequence) == 1:
            row[sequence[0]] = -np.inf
    return row


def set_row(rows: jax.Array, slot: jax.Array, row: jax.Array) -> jax.Array:
    """rows f32[R, V] with rows[slot] = row f32[V]; the model runner jits it, `rows` donated."""
    return rows.at[slot].set(row)


class BiasRows:
    def __init__(self, num_slots: int, vocab_size: int, set_row_fn, sharding=None):
        """`set_row_fn` is the model runner's jit of `set_row`; `sharding`: where the rows live
        (the runner's devices, each holding them whole)."""
        self.vocab_size = vocab_size
        self.rows = jnp.zeros((num_slots, vocab_size), jnp.float32, device=sharding)  # [R, V]
        self._set_row = set_row_fn
        self._free = list(range(num_slots - 1, 0, -1))
        self.num_sends = 0  # rows sent so far: a step built before a send is stale
        # request_id -> (request, slot, static row, bans last sent)
        self._owners: dict[str, tuple[Request, int, np.ndarray, frozenset[int]]] = {}

    def slots_for(self, requests: list[Request]) -> np.ndarray:
        """i32[len(requests)]: each request's row, sending new or changed rows to the device."""
        self._release_dead()
        slots = np.zeros(len(requests), np.int32)
        for i, request in enumerate(requests):
            if not needs_row(request):
                continue
            owner = self._owners.get(request.request_id)
            if owner is None:
                owner = (request, self._free.pop(), _static_row(request, self.vocab_size), None)
            _, slot, static, sent = owner
            bans = next_token_bans(request)
            if bans != sent:
                row = static.copy()
                row[list(bans)] = -np.inf
                self.rows = self._set_row(self.rows, np.int32(slot), row)
                self.num_sends += 1
            self._owners[request.request_id] = (request, slot, static, bans)
            slots[i] = slot
        return slots

    def _release_dead(self) -> None:
        """Rows of finished or preempted requests go back (a resumed request re-sends its own)."""
        for request_id, (request, slot, _, _) in list(self._owners.items()):
            if request.status != RequestStatus.RUNNING:
                del self._owners[request_id]
                self._free.append(slot)
