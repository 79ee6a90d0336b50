"""Validation and tokenization at the edge: nothing half-enters the engine."""

import dataclasses

from jvllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict


def tokenize_prompt(prompt: PromptType, tokenizer) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids) for a str, a token-id list, or vLLM's dict forms."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("this model ships no tokenizer: pass the prompt as token ids")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, _token_list(prompt)
    raise TypeError(
        f"prompt must be a str, a list of token ids, or a dict, got {type(prompt).__name__}"
    )


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's): the request then shares prefix-cache blocks only
    with requests of the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty str (or None), got {salt!r}")
    return salt


def _token_list(ids) -> list[int]:
    ids = list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
    return ids


def truncate_prompt(
    prompt_token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's: -1 means max_model_len; None
    keeps the whole prompt); a truncation longer than max_model_len is refused, as in vLLM."""
    k = truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
        raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {k!r}")
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}); "
            "select a smaller truncation size"
        )
    return prompt_token_ids[-k:]


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    has_tokenizer: bool,
) -> tuple[list[int], SamplingParams]:
    """The prompt, truncated as `params` asks, and `params` checked against it and the model,
    with max_tokens=None resolved to the room max_model_len leaves (vLLM's); raises
    ValueError/TypeError naming what is wrong."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    prompt_token_ids = truncate_prompt(
        prompt_token_ids, params.truncate_prompt_tokens, max_model_len
    )
    if params.max_tokens is None:  # at least 1, so that a prompt with no room is refused below
        room = max(max_model_len - len(prompt_token_ids), 1)
        params = dataclasses.replace(params, max_tokens=max(room, params.min_tokens))
    if params.stop and not has_tokenizer:
        raise ValueError(
            "stop strings need a tokenizer (they are found in the text), and this engine "
            "has none; stop on token ids instead (stop_token_ids)"
        )
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty (it has 0 tokens)")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt token ids must be in [0, {vocab_size}) for this model, got {bad[:5]}"
        )
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt ({len(prompt_token_ids)} tokens) leaves no room to generate within "
            f"max_model_len ({max_model_len}); shorten the prompt or raise max_model_len"
        )
    check_fits(len(prompt_token_ids), params.max_tokens, max_model_len)
    return prompt_token_ids, params


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """A prompt and its max_tokens within max_model_len, or a ValueError saying what to change."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValueError(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} "
            f"tokens, more than max_model_len ({max_model_len}); shorten the prompt, lower "
            "max_tokens, or raise max_model_len"
        )


def check_no_lora(lora_request) -> None:
    """vLLM's `lora_request` where jvllm takes no adapter (pooling models)."""
    if lora_request is not None:
        raise ValueError("lora_request must be None: pooling models take no LoRA adapters")


def check_priority(priority, scheduling_policy: str) -> None:
    """A request's `priority`: an int, and 0 unless the engine schedules by priority (vLLM's
    rule)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"priority={priority} needs the engine option scheduling_policy='priority' "
            f"(--scheduling-policy priority); this engine's is {scheduling_policy!r}"
        )
