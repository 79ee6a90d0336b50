"""Watch one request's lifecycle step by step (seed 003's lab, as a library function)."""

from typing import NamedTuple

from jvllm.engine.llm_engine import LLMEngine
from jvllm.sampling_params import SamplingParams


class Event(NamedTuple):
    request_id: str
    status: str
    num_computed_tokens: int
    num_tokens: int


def trace_request(prompt: str, max_tokens: int = 4, **engine_kwargs) -> list[Event]:
    """Run one greedy, ignore-EOS request and snapshot it after every engine step.

    The request is seen in `scheduler.running` while it lives, and in the step's finished
    requests in the step that ends it (it has already left `running` by then).
    """
    engine = LLMEngine(**engine_kwargs)
    request_id = "req-0"
    engine.add_request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    events = []
    while engine.has_unfinished_requests():
        engine.step()
        live = list(engine.scheduler.running) + engine.last_finished_requests
        events.extend(
            Event(r.request_id, r.status.name, r.num_computed_tokens, r.num_tokens)
            for r in live
            if r.request_id == request_id
        )
    return events
