"""Structured outputs' cost (issue 21): one engine, the same prompts with and without a JSON schema.

    python -m jvllm.benchmarks.throughput --structured json

The throughput benchmark's `--structured` runs this, with its flags for the model and the
engine. Both runs stop at EOS (or the grammar's end) and at the same max_tokens, so their output
lengths may differ: the figures count the tokens the requests returned. A step's host time is
split as the engine spends it: filling the masks (StructuredOutputManager.mask_seconds), calling
the model, waiting for the device, and the rest of the engine (scheduling, detokenizing,
advancing the matchers).
"""

import dataclasses
import json
import statistics
import time

from jvllm import LLM, SamplingParams, StructuredOutputsParams

# Small but with every bound a grammar enforces: lengths, a range, an item count, an enum.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "role"],
    "additionalProperties": False,
}
CHOICES = {"json": SCHEMA}  # --structured's choices

JSONSCHEMA_MISSING = (
    "--structured checks the outputs against the schema with jsonschema, which is not "
    "installed here: `pip install -e '.[test]'` (or `pip install jsonschema`) installs it"
)


def require_jsonschema() -> None:
    """Exit at once, not after minutes of generating, when jsonschema is missing."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise SystemExit(JSONSCHEMA_MISSING) from None


def is_valid(text: str, schema: dict) -> bool:
    """Whether `text` parses as JSON and validates against `schema`."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@dataclasses.dataclass
class _Totals:
    """One mode's timed iterations: tokens/s of each, and sums over all of them."""

    tok_s: list[float] = dataclasses.field(default_factory=list)
    num_outputs: int = 0
    num_valid: int = 0
    num_tokens: int = 0
    num_steps: int = 0
    wall: float = 0.0
    mask: float = 0.0
    dispatch: float = 0.0
    device_wait: float = 0.0


def _generate(llm: LLM, prompts, params: SamplingParams, totals: _Totals, schema: dict) -> None:
    """Run `prompts` to completion, stepping the engine here so the steps can be counted."""
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    structured = engine.structured_outputs
    mask, dispatch = structured.mask_seconds, runner.dispatch_seconds
    wait = runner.device_wait_seconds
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"structured-bench-{i}", prompt, params)
    finished, num_steps = [], 0
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        num_steps += 1
    wall = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    totals.tok_s.append(num_tokens / wall)
    totals.num_outputs += len(finished)
    totals.num_valid += sum(is_valid(o.outputs[0].text, schema) for o in finished)
    totals.num_tokens += num_tokens
    totals.num_steps += num_steps
    totals.wall += wall
    totals.mask += structured.mask_seconds - mask
    totals.dispatch += runner.dispatch_seconds - dispatch
    totals.device_wait += runner.device_wait_seconds - wait


def bench_structured(
    llm: LLM, prompt_sets, params: SamplingParams, schema: dict, disable_any_whitespace: bool
) -> dict[str, _Totals]:
    """{"unconstrained", "constrained"}: each prompt set with `params` as given (ignore_eos
    off) and with the schema added, one after the other, after a warm-up of each.

    The engine must not cache prefixes: the second run would skip the first's prefills."""
    if llm.llm_engine.scheduler.kv_cache_manager.enable_prefix_caching:
        raise ValueError("bench_structured needs an engine with enable_prefix_caching=False")
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=disable_any_whitespace)
    modes = {
        "unconstrained": params,
        "constrained": dataclasses.replace(params, structured_outputs=constraint),
    }
    # Warm-up: the executables' page-in, the grammar's compile and the tokenizer's token table.
    for mode_params in modes.values():
        _generate(llm, prompt_sets[0][:2], mode_params, _Totals(), schema)
    results = {name: _Totals() for name in modes}
    for prompts in prompt_sets:  # alternating, so a neighbour's load falls on both alike
        for name, mode_params in modes.items():
            _generate(llm, prompts, mode_params, results[name], schema)
    return results


def print_structured(results: dict[str, _Totals]) -> None:
    """The two modes' figures, their ratio, the valid fraction and the steps' host time."""
    for name, t in results.items():
        step_ms = 1e3 * t.wall / t.num_steps
        mask, dispatch, wait = (1e3 * s / t.num_steps for s in (t.mask, t.dispatch, t.device_wait))
        print(
            f"jvllm [{name}]: {statistics.median(t.tok_s):.1f} output tok/s "
            f"({t.num_tokens / t.num_outputs:.1f} tokens a request, {t.num_steps} steps)"
        )
        print(
            f"jvllm [{name}] a step {step_ms:.2f} ms: masks {mask:.2f} ms, calling the model "
            f"{dispatch:.2f} ms, waiting for the device {wait:.2f} ms, the engine around them "
            f"{step_ms - mask - dispatch - wait:.2f} ms"
        )
        print(
            f"jvllm [{name}] valid JSON for the schema: {t.num_valid}/{t.num_outputs} "
            f"({t.num_valid / t.num_outputs:.0%})"
        )
    base, ours = (statistics.median(results[n].tok_s) for n in ("unconstrained", "constrained"))
    constrained = results["constrained"]
    print(
        f"jvllm [constrained] / jvllm [unconstrained]: throughput {ours / base:.2f}x "
        f"(goal >= 0.85x); mask fill {1e3 * constrained.mask / constrained.num_steps:.2f} ms "
        "a step"
    )
