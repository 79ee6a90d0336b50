"""What one scheduling step decides: the requests it computes, how many tokens each, their
blocks, and what the worker encodes and drops for their images (core/scheduler.py makes it)."""

from dataclasses import dataclass, field

from jvllm.core.request import Request


@dataclass
class SchedulerOutput:
    """What one step computes. Request `r` computes tokens `all_token_ids[c : c + n]` at positions
    `c .. c + n - 1`, with `c = r.num_computed_tokens` (not yet advanced: `update_from_output`
    does that) and `n = num_scheduled_tokens[r.request_id]`."""

    # In the row order the model runner uses.
    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Each scheduled request's block table after this step's allocation.
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    # With hybrid KV groups (core/kv_groups.py), its table in each windowed group; else empty.
    window_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    preempted_requests: list[Request] = field(default_factory=list)
    # Requests finished by schedule() itself (FINISHED_IGNORED: they can never fit).
    finished_requests: list[Request] = field(default_factory=list)
    # A decode window (num_steps > 1): every request decodes, and request r samples up to
    # window_limits[r] tokens in one device call, each fed back as the next input. Its blocks
    # already cover them.
    num_steps: int = 1
    window_limits: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (core/spec_decode.py): the drafts each decoding request computes
    # after its last token, counted in its num_scheduled_tokens but not in its all_token_ids.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Images: each request's mm_features indices that the worker encodes before the step (an
    # image is encoded whole, when its first scheduled token needs it), and the encoder cache
    # entries evicted since the last step, which the worker drops.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    freed_encoder_hashes: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests

    @property
    def is_decode_only(self) -> bool:
        """Every scheduled request computes exactly one token (the runner's T = S buckets)."""
        return all(n == 1 for n in self.num_scheduled_tokens.values())

    def will_sample(self, request: Request) -> bool:
        """True when this step's tokens catch the request up, so its last logits are sampled.
        Valid between `schedule()` and `update_from_output()`."""
        num_computed = request.num_computed_tokens + self.num_known_tokens(request)
        return num_computed == request.num_tokens

    def num_known_tokens(self, request: Request) -> int:
        """The request's scheduled tokens that are in its all_token_ids (all but its drafts)."""
        num_drafts = len(self.spec_token_ids.get(request.request_id, ()))
        return self.num_scheduled_tokens[request.request_id] - num_drafts
