"""A request's output constraint from its HTTP fields: OpenAI's `response_format`, vLLM's
`structured_outputs` object and its older `guided_*` fields, one constraint at most."""

from __future__ import annotations

from typing import Any

from jvllm.entrypoints.openai.protocol import OpenAIError
from jvllm.sampling_params import StructuredOutputsParams
from jvllm.structured_output.grammar import validate

# vLLM's older fields and the StructuredOutputsParams field each sets.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _from_response_format(response_format: dict) -> dict | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise OpenAIError(
                'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                '"schema": {...}}',
                param="response_format",
            )
        return {"json": spec["schema"]}
    raise OpenAIError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
        "'json_schema'",
        param="response_format",
    )


def structured_outputs(request) -> StructuredOutputsParams | None:
    """The request's constraint, checked (an invalid schema, regex or grammar is a 400 naming
    the field it came from), or None when it asks for none."""
    given: list[tuple[str, dict]] = []
    if request.response_format is not None:
        fields = _from_response_format(request.response_format)
        if fields is not None:
            given.append(("response_format", fields))
    if request.structured_outputs is not None:
        given.append(("structured_outputs", dict(request.structured_outputs)))
    guided = {
        field: getattr(request, name)
        for name, field in _GUIDED_FIELDS.items()
        if getattr(request, name) is not None
    }
    if guided:
        given.append(
            (", ".join(n for n in _GUIDED_FIELDS if getattr(request, n) is not None), guided)
        )
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError(
            f"give one output constraint, not several: {', '.join(n for n, _ in given)}",
            param=given[1][0],
        )
    return checked(given[0][0], given[0][1])


def checked(what: str, fields: dict[str, Any], param: str | None = None) -> StructuredOutputsParams:
    """StructuredOutputsParams(**fields), validated by the grammar backend; errors are 400s
    saying `what` and naming `param` (default: `what`)."""
    try:
        params = StructuredOutputsParams(**fields)
        validate(params)
    except (ValueError, TypeError) as e:
        raise OpenAIError(f"{what}: {e}", param=param or what) from None
    return params
