"""Speculative decoding on the host: which requests get drafts, how many, and what the target
model's tokens accept of them. The drafts themselves come from spec_decode/ngram.py, or from
a draft model (worker/draft_model.py), whose proposals the engine hands over after each step
(`set_proposals`).

A decoding request with drafts d1..dk computes its last token and the drafts in one step; the
target's token at each of those positions is t0..tk, sampled as decoding one token at a time
would sample it there (worker/draft_scoring.py: the same logit processors, penalties, filters
and seeded key of that output index). d(i) is accepted while it equals t(i-1), and the token
after the accepted run is the target's (the first disagreement's, or the bonus tk). For a
deterministic draft such as an n-gram's, that is rejection sampling with a draft distribution of
probability 1 on d(i): the tokens follow the target's distribution exactly, a seeded request
gives the same tokens with and without speculation, and a greedy one the argmax's.
"""

import dataclasses

import numpy as np

from jvllm.core.request import Request
from jvllm.core.token_bans import has_changing_bans, next_token_bans
from jvllm.spec_decode.config import MODEL_METHODS, SpeculativeConfig
from jvllm.spec_decode.ngram import propose_ngram_drafts


def can_draft(request: Request) -> bool:
    """Whether verification can sample each draft position as the sampler would: every
    generating request (a structured output's mask at each position comes from its grammar
    advanced over the drafts before it, structured_output/manager.py)."""
    return request.pooling_params is None


def _num_drafts_the_step_row_covers(request: Request, draft_token_ids: list[int]) -> int:
    """How many of the drafts to keep so that every position they verify, the bonus's too,
    bans what the request's next token bans: the step has one bias row per request
    (worker/bias_rows.py). Stop tokens below min_tokens and a multi-token bad word's last
    token are banned at some positions only; the drafts end before the first that differs."""
    if not has_changing_bans(request):
        return len(draft_token_ids)
    bans = next_token_bans(request)
    for n in range(1, len(draft_token_ids) + 1):
        if next_token_bans(request, draft_token_ids[:n]) != bans:
            return n - 1
    return len(draft_token_ids)


def accept_drafts(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The tokens a step gives a request: its drafts while each equals the target's token
    before it, then the target's next token. `target_token_ids` has len(drafts) + 1 entries
    (t0..tk); the result 1..k+1 tokens."""
    for i, draft in enumerate(draft_token_ids):
        if draft != target_token_ids[i]:
            return [*draft_token_ids[:i], target_token_ids[i]]
    return [*draft_token_ids, target_token_ids[len(draft_token_ids)]]


@dataclasses.dataclass
class SpecDecodingStats:
    """vLLM's spec-decode counters: requests-steps that carried drafts, the drafts, the accepted
    drafts, and the accepted ones at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed ones (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class DraftProposer:
    """Proposes each decoding request's drafts before it is scheduled, and counts what the
    verification accepted."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens
        )
        # A draft model's proposals: request id -> (the request's num_tokens they follow,
        # drafts); used once, and only while the request still has that many tokens.
        self._proposals: dict[str, tuple[int, list[int]]] = {}

    @property
    def uses_draft_model(self) -> bool:
        return self.config.method in MODEL_METHODS

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request that samples this step needs past its tokens (vLLM's)."""
        return self.config.num_lookahead_tokens

    def set_proposals(self, proposals: dict[str, tuple[int, list[int]]]) -> None:
        """A draft model's drafts after a step (ModelRunner.propose_drafts)."""
        self._proposals.update(proposals)

    def discard(self, request_id: str) -> None:
        """Forget a request's proposal (it finished or was preempted)."""
        self._proposals.pop(request_id, None)

    def observe_window(
        self, request: Request, drafts: list[int], rounds: list[tuple[int, int]]
    ) -> None:
        """Count a window of speculative rounds' drafts as the host would have proposed them
        round by round: `drafts` the first round's (the scheduler's), `rounds` each round's
        (drafts proposed, accepted) on the device, which proposes k whatever room a request
        has left; a later round counts only the drafts that max_tokens and max_model_len left
        room for (drafts_for's caps), and none where there was no room (the request, before
        its window, has not taken the window's tokens yet)."""
        (_, first), *later = rounds
        if drafts:
            self.stats.observe(len(drafts), min(first, len(drafts)))
        num_taken = first + 1  # a padding draft the target's token matched is taken too
        params = request.sampling_params
        for proposed, accepted in later:
            room = min(
                params.max_tokens - request.num_output_tokens - num_taken - 1,
                self.max_model_len - request.num_tokens - num_taken - 1,
            )
            proposed = min(proposed, room)
            if proposed > 0:  # n-gram drafts may find none: a round of padding
                self.stats.observe(proposed, min(accepted, proposed))
            num_taken += accepted + 1

    def drafts_for(self, request: Request, token_budget: int) -> list[int]:
        """Up to num_speculative_tokens drafts for a request that decodes this step, within
        what it may still output (max_tokens, max_model_len: every draft and the token after
        them must be able to stand) and the step's `token_budget` (its last token and drafts).
        """
        params = request.sampling_params
        num_drafts = min(
            self.config.num_speculative_tokens,
            params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
            token_budget - 1,
        )
        if self.uses_draft_model:
            num_tokens, proposed = self._proposals.pop(request.request_id, (-1, []))
            if num_tokens != request.num_tokens:  # none, or one for a length it has left
                return []
        if num_drafts < 1 or not can_draft(request):
            return []
        if self.uses_draft_model:
            drafts = proposed[:num_drafts]
        else:
            drafts = propose_ngram_drafts(
                np.asarray(request.all_token_ids, np.int64),
                self.config.prompt_lookup_min,
                self.config.prompt_lookup_max,
                num_drafts,
            )
        if request.structured_output is not None:  # only drafts its grammar accepts
            drafts = drafts[: request.structured_output.num_valid(drafts)]
        return drafts[: _num_drafts_the_step_row_covers(request, drafts)]
