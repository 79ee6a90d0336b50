"""A step's results on the host: the sampled tokens and logprobs that the engine's update reads,
fetched from the step's device outputs."""

import dataclasses

import numpy as np


@dataclasses.dataclass
class ModelRunnerOutput:
    """One step's results on the host, rows in scheduled-request order; the logprob fields are
    None when no request of the step asked for them.

    A decode window returns each request's samples as a list (up to its window limit) and its
    logprob arrays with a leading step axis [k, num_reqs, ...]."""

    sampled_token_ids: np.ndarray | list[list[int]]  # i32[num_reqs], or a list per request
    logprobs: tuple[np.ndarray, ...] | None = None  # top ids, top logprobs, sampled lp, rank
    prompt_logprobs: tuple[np.ndarray, ...] | None = None  # the same per scheduled token [T]
    # A window of speculative rounds (worker/spec_window.py): each request's (drafts proposed,
    # drafts accepted) in each round it took part in; None for any other step.
    round_drafts: list[list[tuple[int, int]]] | None = None


def fetch_output(
    out, rows: list[int], is_window: bool, any_logprobs: bool, any_prompt_logprobs: bool
) -> ModelRunnerOutput:
    """Wait for a step's `out` (a SamplerOutput, or a window's outputs) and take the scheduled
    requests' rows: `rows[i]` holds request i (a padded batch's other rows are dropped).
    `any_prompt_logprobs` only for a single step that computed them."""
    num_reqs = len(rows)
    if is_window:
        token_ids = np.asarray(out.token_ids)[:, :num_reqs]  # [k, R]
        num_sampled = np.asarray(out.num_sampled)[:num_reqs].tolist()
        sampled = [token_ids[:n, i].tolist() for i, n in enumerate(num_sampled)]
    else:
        sampled = np.asarray(out.sampled_token_ids)[rows]
    result = ModelRunnerOutput(sampled)
    if any_logprobs:
        fields = (out.topk_token_ids, out.topk_logprobs, out.sampled_logprobs, out.sampled_ranks)
        at = (slice(None), slice(num_reqs)) if is_window else rows
        result.logprobs = tuple(np.asarray(f)[at] for f in fields)
    if any_prompt_logprobs:
        fields = (
            out.prompt_topk_token_ids,
            out.prompt_topk_logprobs,
            out.prompt_target_logprobs,
            out.prompt_target_ranks,
        )
        result.prompt_logprobs = tuple(np.asarray(f) for f in fields)
    return result


def as_window(result: ModelRunnerOutput) -> ModelRunnerOutput:
    """A single step's `result` in a decode window's form, a window of one step: each
    request's token a list, its logprobs with a leading step axis (a group of ranks runs a
    rank's scheduled window as one step where another rank's step is not a window)."""
    logprobs = result.logprobs and tuple(a[None] for a in result.logprobs)
    sampled = [[int(t)] for t in result.sampled_token_ids]
    return dataclasses.replace(result, sampled_token_ids=sampled, logprobs=logprobs)
