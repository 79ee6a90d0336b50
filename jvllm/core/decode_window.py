"""Multi-step decode on the host side: which requests a decode window can carry, and how far.

A decode window (`num_scheduler_steps=k`) runs up to k decode steps in one device call, each
sampled token fed back as the next input. The device stops a row by itself at its EOS, a stop
token id or its limit, so everything that decides when a request stops must be known before the
call; what cannot be (multi-token bad words and grammar masks, which follow the tokens just
sampled) makes the step a single one. Stop strings need the text: the host checks them afterwards and drops the
tokens past a stop.
"""

from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request

# Stop token ids a row carries into the window (the request's own plus the model's other EOS
# ids): a request with more runs in single steps.
MAX_WINDOW_STOP_IDS = 16


def has_token_dependent_bans(request: Request) -> bool:
    """Bans that follow each sampled token: a grammar's mask (structured outputs), and
    multi-token bad words, which ban a token only after the others."""
    if request.structured_output is not None:
        return True
    return any(len(word) > 1 for word in request.bad_words_token_ids)


def fits_window(request: Request) -> bool:
    """Whether the request's stops and logit processors can run inside a decode window."""
    if has_token_dependent_bans(request):
        return False
    return len(window_stop_token_ids(request)) <= MAX_WINDOW_STOP_IDS


def window_limit(request: Request, num_steps: int, max_model_len: int) -> int:
    """The most tokens a decoding request may sample in a window of `num_steps` (>= 1).

    Besides max_tokens and max_model_len, a request below min_tokens stops at min_tokens, so
    that its banned stop ids and its stop checks stay the same for the whole window."""
    params = request.sampling_params
    limit = min(
        num_steps,
        params.max_tokens - request.num_output_tokens,
        max_model_len - request.num_tokens,
    )
    if request.num_output_tokens < params.min_tokens:
        limit = min(limit, params.min_tokens - request.num_output_tokens)
    return max(limit, 1)


def window_stop_token_ids(request: Request) -> list[int]:
    """The token ids that end the request inside the window: none below min_tokens (they are
    banned there), else its stop token ids and its EOS id unless it ignores EOS."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return []
    ids = list(params.stop_token_ids)
    if not params.ignore_eos and request.eos_token_id is not None:
        ids.append(request.eos_token_id)
    return ids


def spec_window_lookahead(request: Request, limit: int, num_drafts: int, max_model_len: int) -> int:
    """KV slots past a window's `limit` for a request of a window of speculative rounds: its last
    round's draft proposes `num_drafts` tokens past its last kept position (vLLM's lookahead
    slots), within max_model_len."""
    return max(0, min(num_drafts, max_model_len - request.num_computed_tokens - limit))


def window_capacity(max_num_batched_tokens: int, num_drafts: int) -> int:
    """The most requests a window takes: each round of one computes its last token and
    `num_drafts` drafts, within max_num_batched_tokens (worker/step_compiler.py compiles the
    windows of that many, worker/kv_budget.py reserves their activations)."""
    return max_num_batched_tokens // (num_drafts + 1)


def fits_spec_window(request: Request, num_drafts: int, max_model_len: int) -> bool:
    """Whether a request can run in a window of speculative rounds besides fitting a decode
    window: its first round's k drafts stand inside max_model_len."""
    return request.num_tokens + num_drafts <= max_model_len


def decode_window_limits(
    config: SchedulerConfig,
    running: list[Request],
    has_newcomers: bool,
    kv: KVCacheManager,
    num_drafts: int = 0,
) -> list[int] | None:
    """Each running request's limit when this step can be a decode window of
    k = num_scheduler_steps, else None: every running request decodes and fits a window, no
    waiting request could be admitted now (`has_newcomers`), and the free blocks cover every
    request's window without preempting. With speculation (`num_drafts` per round > 0) the
    window runs k rounds of up to num_drafts + 1 tokens each (worker/spec_window.py)."""
    num_steps = config.num_scheduler_steps
    if num_steps == 1 or not running:
        return None
    if has_newcomers:
        return None  # prefill the newcomers now rather than after a window
    if len(running) > window_capacity(config.max_num_batched_tokens, num_drafts):
        return None
    limits, num_blocks = [], 0
    for request in running:
        if request.num_computed_tokens != request.num_tokens - 1 or not fits_window(request):
            return None
        if num_drafts and not fits_spec_window(request, num_drafts, config.max_model_len):
            return None
        limit = window_limit(request, num_steps * (num_drafts + 1), config.max_model_len)
        limits.append(limit)
        lookahead = spec_window_lookahead(request, limit, num_drafts, config.max_model_len)
        num_tokens = request.num_computed_tokens + limit + lookahead
        num_blocks += kv.num_new_blocks(request, num_tokens)
    return limits if num_blocks <= kv.num_free_blocks else None
