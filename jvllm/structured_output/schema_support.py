"""JSON schemas rewritten where llguidance would refuse a part that JSON Schema lets go.

Each rewrite keeps every value the grammar then admits valid under the schema as it came:
- a string `format` llguidance does not know (pydantic's "path", "binary", "password",
  "ipvanyaddress", ...) is dropped: JSON Schema 2020-12 makes `format` an annotation unless a
  validator opts in, so any string is valid.
"""

import functools
import json

import llguidance

from jvllm.structured_output.json_schema import each_schema


def supported(schema):
    """`schema` (a dict, already a private copy) with the rewrites above made in place."""
    for node in each_schema(schema):
        if isinstance(node.get("format"), str) and not _takes(
            json.dumps({"format": node["format"]})
        ):
            del node["format"]
    return schema


@functools.lru_cache(maxsize=1024)
def _takes(schema: str) -> bool:
    """Whether llguidance compiles `schema` (the JSON text of a one-keyword schema)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except Exception:  # noqa: BLE001 - llguidance raises its own types for what it refuses
        return False
    return not llguidance.LLMatcher.validate_grammar(grammar)
