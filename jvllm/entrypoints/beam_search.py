"""Beam search on top of the engine, as vLLM's `LLM.beam_search` does it.

Each step runs every live beam as a one-token request asking for `2 * beam_width` logprobs; a
beam's tokens so far are its prompt, so beams that share a prefix share its KV blocks through the
prefix cache and only their last partial block is recomputed. `BeamSearch` holds the beams; the
offline `LLM` and the server's `AsyncLLM` each drive its steps.
"""

import asyncio
import dataclasses

from tqdm.auto import tqdm

from jvllm.core.engine_config import LoadConfig
from jvllm.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from jvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def beam_score(
    tokens: list[int], cum_logprob: float, eos_token_ids: tuple[int, ...], length_penalty: float
) -> float:
    """vLLM's score: the cumulative logprob over the length (prompt included, a final EOS not)
    to the power `length_penalty`."""
    seq_len = len(tokens)
    if tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cum_logprob / (seq_len**length_penalty)


def check_beam_search(width: int, load_config: LoadConfig) -> None:
    """What the engine must allow for a search of `width` beams: their candidates' logprobs."""
    if load_config.logprobs_mode.endswith("_logits"):
        raise ValueError(
            f"beam search ranks beams by logprobs, and this engine's logprobs_mode is "
            f"{load_config.logprobs_mode!r}; start it with a *_logprobs mode"
        )
    max_logprobs = load_config.max_logprobs
    if 2 * width > max_logprobs:
        raise ValueError(
            f"beam_width must be at most max_logprobs / 2 = {max_logprobs // 2} "
            f"(each step ranks 2 * beam_width candidates), got {width}; raise max_logprobs"
        )


@dataclasses.dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    cache_salt: str | None
    completed: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


class BeamSearch:
    """The beams of some prompts: `live_prompts()` -> run them one token -> `advance()`, up to
    `max_tokens` times or until no beam is left, then `results()`. Each prompt's beams run
    under its `cache_salt` (None: unsalted)."""

    def __init__(
        self,
        prompts_token_ids: list[list[int]],
        cache_salts: list[str | None],
        params: BeamSearchParams,
        eos_token_ids: tuple[int, ...],
        load_config: LoadConfig,
    ):
        check_beam_search(params.beam_width, load_config)
        width = params.beam_width
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.step_params = SamplingParams(
            n=1,
            logprobs=2 * width,
            max_tokens=1,
            temperature=params.temperature,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=False,
        )
        self._instances = [
            _Instance([BeamSearchSequence(tokens=list(ids), logprobs=[])], salt)
            for ids, salt in zip(prompts_token_ids, cache_salts, strict=True)
        ]
        self._live: list[tuple[_Instance, BeamSearchSequence]] = []

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(
            beam.tokens, beam.cum_logprob, self.eos_token_ids, self.params.length_penalty
        )

    def live_prompts(self) -> list[dict]:
        """This step's one-token requests, one per live beam (none: the search is over)."""
        self._live = [(inst, beam) for inst in self._instances for beam in inst.beams]
        return [
            {"prompt_token_ids": beam.tokens, "cache_salt": inst.cache_salt}
            for inst, beam in self._live
        ]

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """Extend each live beam by each of its candidates (the logprobs of its one token) and
        keep the `beam_width` best of each prompt; those ending in EOS are complete."""
        candidates: dict[int, list[BeamSearchSequence]] = {id(i): [] for i in self._instances}
        for (inst, beam), logprobs in zip(self._live, step_logprobs):
            for token_id, logprob in logprobs.items():
                new = BeamSearchSequence(
                    tokens=beam.tokens + [token_id],
                    logprobs=beam.logprobs + [logprobs],
                    cum_logprob=beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    inst.completed.append(new)
                else:
                    candidates[id(inst)].append(new)
        for inst in self._instances:
            ranked = sorted(candidates[id(inst)], key=self._key, reverse=True)
            inst.beams = ranked[: self.params.beam_width]

    def results(self, tokenizer) -> list[BeamSearchOutput]:
        """The `beam_width` best sequences of each prompt, with their text (prompt included)."""
        results = []
        for inst in self._instances:
            for beam in inst.beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(inst.completed + inst.beams, key=self._key, reverse=True)
            best = best[: self.params.beam_width]
            for beam in best:
                if tokenizer is not None:
                    beam.text = tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(sequences=best))
        return results


def beam_search(
    llm,
    prompts,
    params: BeamSearchParams,
    use_tqdm: bool,
    concurrency_limit: int | None,
    lora_request=None,
) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: the prompts' searches `concurrency_limit` prompts at a time (None:
    all at once), each step of a group one `generate` call over its live beams, with the
    LoRA adapter `lora_request` (None: the base model)."""
    from jvllm.engine.input_processor import check_fits, prompt_cache_salt, tokenize_prompt

    if concurrency_limit is not None and (
        not isinstance(concurrency_limit, int)
        or isinstance(concurrency_limit, bool)
        or concurrency_limit < 1
    ):
        raise ValueError(
            f"concurrency_limit must be None or an int >= 1, got {concurrency_limit!r}"
        )
    engine = llm.llm_engine
    tokenizer = engine.get_tokenizer()
    prompts_token_ids = [tokenize_prompt(prompt, tokenizer)[1] for prompt in prompts]
    salts = [prompt_cache_salt(prompt) for prompt in prompts]
    for ids in prompts_token_ids:  # refused now rather than after steps of work
        check_fits(len(ids), params.max_tokens, engine.max_model_len)
    group = concurrency_limit or max(len(prompts), 1)
    starts = range(0, len(prompts), group)
    results = []
    with tqdm(
        total=len(starts) * params.max_tokens, desc="Beam search", disable=not use_tqdm
    ) as bar:
        for start in starts:
            search = BeamSearch(
                prompts_token_ids[start : start + group],
                salts[start : start + group],
                params,
                engine.eos_token_ids,
                engine.engine_config.load_config,
            )
            for step in range(params.max_tokens):
                step_prompts = search.live_prompts()
                if not step_prompts:
                    bar.update(params.max_tokens - step)
                    break
                outputs = llm.generate(
                    step_prompts, search.step_params, use_tqdm=False, lora_request=lora_request
                )
                search.advance([out.outputs[0].logprobs[0] for out in outputs])
                bar.update(1)
            results += search.results(tokenizer)
    return results


async def beam_search_async(
    engine,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    cache_salt: str | None = None,
    priority: int = 0,
    lora_request=None,
) -> BeamSearchOutput:
    """The same search for one prompt through an `AsyncLLM`: each step's beams run at once, as
    requests `{request_id}-{step}-{beam}` of the search's `priority` and LoRA adapter."""
    inner = engine.engine
    load_config = inner.engine_config.load_config
    search = BeamSearch([prompt_token_ids], [cache_salt], params, inner.eos_token_ids, load_config)
    for step in range(params.max_tokens):
        step_prompts = search.live_prompts()
        if not step_prompts:
            break
        outputs = await asyncio.gather(
            *(
                _last(
                    engine.generate(
                        prompt,
                        search.step_params,
                        f"{request_id}-{step}-{i}",
                        priority=priority,
                        lora_request=lora_request,
                    )
                )
                for i, prompt in enumerate(step_prompts)
            )
        )
        search.advance([out.outputs[0].logprobs[0] for out in outputs])
    return search.results(None)[0]


async def _last(outputs):
    async for output in outputs:
        last = output
    return last
