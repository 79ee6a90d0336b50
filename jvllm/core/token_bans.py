"""The tokens a request's logit processors ban for its next position only: stop tokens below
min_tokens, and the last token of a bad word whose other tokens end the output. A step's bias
row holds them (worker/bias_rows.py); speculative decoding keeps a request's drafts only while
every position they verify bans the same (core/spec_decode.py)."""

from collections.abc import Sequence

from jvllm.core.request import Request


def next_token_bans(request: Request, draft_token_ids: Sequence[int] = ()) -> frozenset[int]:
    """The bans of the token after the request's output and `draft_token_ids` (tokens taken
    as output, not appended yet)."""
    params = request.sampling_params
    bans = set()
    if request.num_output_tokens + len(draft_token_ids) < params.min_tokens:
        bans.update(params.stop_token_ids)
        if not params.ignore_eos and request.eos_token_id is not None:
            bans.add(request.eos_token_id)
    for sequence in request.bad_words_token_ids:
        prefix = sequence[:-1]
        if not prefix:
            continue
        tail = [*request.output_token_ids[-len(prefix) :], *draft_token_ids][-len(prefix) :]
        if tail == prefix:
            bans.add(sequence[-1])
    return frozenset(bans)


def has_changing_bans(request: Request) -> bool:
    """Whether the request's bans may change from one output position to the next."""
    return request.num_output_tokens < request.sampling_params.min_tokens or any(
        len(sequence) > 1 for sequence in request.bad_words_token_ids
    )
