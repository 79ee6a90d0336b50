"""When a request ends: the checks after each sampled token (EOS, stop token ids, max_tokens,
max_model_len, its grammar), and the refusal of a waiting request that could never run."""

import logging

from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request, RequestStatus

logger = logging.getLogger("jvllm.scheduler")


def check_stop(request: Request, max_model_len: int) -> bool:
    """Stop checks after a token was appended; sets the final status when one fires."""
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    if request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def check_grammar(request: Request, token_id: int) -> bool:
    """Advance a constrained request's matcher past its new token; its end (nothing more can
    follow) stops the request, a token it rejects aborts it."""
    grammar = request.structured_output
    if grammar is None:
        return False
    if not grammar.accept(token_id):
        request.status = RequestStatus.FINISHED_ABORTED
        request.status_message = grammar.error or f"the grammar rejected token {token_id}"
        logger.warning("aborted %s: %s", request.request_id, request.status_message)
        return True
    if grammar.is_terminated:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    return False


def never_fits(
    request: Request, kv: KVCacheManager, config: SchedulerConfig
) -> tuple[RequestStatus, str] | None:
    """(final status, why) for a waiting request that could never be scheduled; None if it
    can be. A new prompt needs room for its first decode step too, unless max_model_len ends
    it before that; a preempted request that outgrew the whole pool ends with what it has."""
    has_outputs = request.num_output_tokens > 0
    num_tokens_needed = request.num_tokens + (0 if has_outputs else 1)
    num_blocks_needed = kv.num_blocks_to_hold(
        min(num_tokens_needed, config.max_model_len),
        config.max_num_batched_tokens,
        request.sampling_params.has_penalties,
    )
    if request.num_prompt_tokens > config.max_model_len:
        return RequestStatus.FINISHED_IGNORED, (
            f"prompt of {request.num_prompt_tokens} tokens is longer than "
            f"max_model_len={config.max_model_len}"
        )
    if num_blocks_needed > kv.num_usable_blocks:
        status = RequestStatus.FINISHED_LENGTH if has_outputs else RequestStatus.FINISHED_IGNORED
        return status, (
            f"request needs {num_blocks_needed} KV blocks of {kv.block_size} tokens, "
            f"the KV cache has {kv.num_usable_blocks}"
        )
    return None
