"""Beam search on top of the engine, as vLLM's `LLM.beam_search` does it.

Each step runs every live beam as a one-token request asking for `2 * beam_width` logprobs; a
beam's tokens so far are its prompt, so beams that share a prefix share its KV blocks through the
prefix cache and only their last partial block is recomputed.
"""

import dataclasses

from jvllm.outputs import BeamSearchOutput, BeamSearchSequence
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


@dataclasses.dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


def beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    from jvllm.engine.input_processor import tokenize_prompt

    engine = llm.llm_engine
    tokenizer = engine.get_tokenizer()
    eos = engine.eos_token_ids
    width = params.beam_width
    if 2 * width > engine.args.max_logprobs:
        raise ValueError(
            f"beam_width must be at most max_logprobs / 2 = {engine.args.max_logprobs // 2} "
            f"(each step ranks 2 * beam_width candidates), got {width}; raise max_logprobs"
        )

    def key(beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    step_params = SamplingParams(
        n=1,
        logprobs=2 * width,
        max_tokens=1,
        temperature=params.temperature,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=False,
    )
    instances = []
    for prompt in prompts:
        _, token_ids = tokenize_prompt(prompt, tokenizer)
        instances.append(_Instance([BeamSearchSequence(tokens=token_ids, logprobs=[])]))
    for _ in range(params.max_tokens):
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = llm.generate(
            [{"prompt_token_ids": b.tokens} for _, b in live], step_params, use_tqdm=False
        )
        candidates: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), out in zip(live, outputs):
            for token_id, logprob in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(
                    tokens=beam.tokens + [token_id],
                    logprobs=beam.logprobs + [out.outputs[0].logprobs[0]],
                    cum_logprob=beam.cum_logprob + logprob.logprob,
                )
                if token_id in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    inst.completed.append(new)
                else:
                    candidates[id(inst)].append(new)
        for inst in instances:
            inst.beams = sorted(candidates[id(inst)], key=key, reverse=True)[:width]
    results = []
    for inst in instances:
        for beam in inst.beams:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(inst.completed + inst.beams, key=key, reverse=True)[:width]
        for beam in best:
            if tokenizer is not None:
                beam.text = tokenizer.decode(beam.tokens)
        results.append(BeamSearchOutput(sequences=best))
    return results
