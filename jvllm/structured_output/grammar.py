"""A request's constraint as an llguidance grammar, checked at the edge.

llguidance (not xgrammar) because it needs no torch at run time, fills packed int32 bitmasks
straight into NumPy arrays, takes JSON schemas, regexes and Lark grammars (GBNF too), and
builds a grammar lazily, so a new schema costs well under a millisecond to start.
"""

import copy
import json

import llguidance

from jvllm.sampling_params import StructuredOutputsParams

# `json_object=True`: any JSON object, as vLLM asks of its grammar backends.
_ANY_OBJECT = '{"type": "object"}'
# Whitespace allowed between JSON tokens: free, as vLLM's, but at most 32 characters a gap
# (indentation 7 levels deep). Unbounded, a small model can pad the end of an object with
# newlines until max_tokens (BENCHMARKS.md, "Structured outputs": 8% of outputs valid, 92%
# with the bound).
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"
# Where a schema keeps schemas: under these keys one, in a list or a dict of them (the dict's
# keys are names, not schema keywords). "enum", "const", "default" and "examples" hold data.
_ONE_SCHEMA = (
    *("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames"),
    *("additionalProperties", "unevaluatedItems", "unevaluatedProperties"),
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_DICTS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (a JSON string) of one constraint; unchecked (see `validate`)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _ANY_OBJECT if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        if kind == "json":
            schema = close_objects(copy.deepcopy(schema))
        if params.disable_any_whitespace:
            defaults = {"whitespace_flexible": False}
        else:
            defaults = {"whitespace_pattern": _JSON_WHITESPACE}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)


def close_objects(schema, in_all_of: bool = False):
    """`schema` with every object closed to properties it does not list
    (`"additionalProperties": false`) where it says nothing of others; changed in place.

    JSON Schema leaves objects open, and llguidance follows it, so a small model fills a
    schema's object with keys it never declared until max_tokens cuts the JSON short. vLLM's
    default grammar backend (xgrammar, strict) emits only the declared keys; so does this.
    Members of an allOf and the object that holds one stay open: each member's keys would be
    "additional" to the others."""
    if isinstance(schema, list):  # "items" as a list (draft 4-7 tuples)
        for item in schema:
            close_objects(item)
        return schema
    if not isinstance(schema, dict):
        return schema
    says_nothing = not any(
        key in schema
        for key in ("additionalProperties", "unevaluatedProperties", "patternProperties")
    )
    is_object = "properties" in schema or schema.get("type") == "object"
    if is_object and says_nothing and "allOf" not in schema and not in_all_of:
        schema["additionalProperties"] = False
    for key, value in schema.items():
        if key in _ONE_SCHEMA:
            close_objects(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for item in value:
                close_objects(item)
        elif key == "allOf" and isinstance(value, list):
            for item in value:
                close_objects(item, in_all_of=True)
        elif key in _SCHEMA_DICTS and isinstance(value, dict):
            for item in value.values():
                close_objects(item)
    return schema


def cache_key(params: StructuredOutputsParams) -> str:
    """Requests with equal keys share one compiled grammar."""
    value = getattr(params, params.kind)
    return json.dumps(
        [params.kind, value, params.disable_any_whitespace], sort_keys=True, ensure_ascii=False
    )


def validate(params: StructuredOutputsParams) -> str:
    """The grammar of `params` after llguidance has checked it; raises ValueError that says
    what is wrong (an invalid schema, regex or grammar) before the request enters the engine."""
    try:
        grammar = grammar_text(params)
    except Exception as e:  # noqa: BLE001 - llguidance raises its own types for bad input
        raise ValueError(f"invalid structured_outputs.{params.kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid structured_outputs.{params.kind}: {error.strip()}")
    return grammar
