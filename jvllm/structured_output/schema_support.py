"""JSON schemas rewritten where llguidance would refuse a part that JSON Schema lets go.

Each rewrite keeps every value the grammar then admits valid under the schema as it came:
- a string `format` llguidance does not know (pydantic's "path", "binary", "password",
  "ipvanyaddress", ...) is dropped: JSON Schema 2020-12 makes `format` an annotation unless a
  validator opts in, so any string is valid;
- an `anyOf` alternative whose `pattern` llguidance cannot compile (a look-around, a
  backreference) is dropped while another alternative remains: pydantic's `Decimal` is a number
  or a string matched by a look-ahead, and the number alone is still valid.
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
        alternatives = node.get("anyOf")
        if isinstance(alternatives, list) and len(alternatives) > 1:
            kept = [a for a in alternatives if all(map(_takes_pattern, _patterns(a)))]
            if kept and len(kept) < len(alternatives):
                node["anyOf"] = kept
    return schema


def _patterns(schema) -> list[str]:
    """Every `pattern` and `patternProperties` regex in `schema`, not following $refs."""
    patterns = []
    for node in each_schema(schema):
        if isinstance(node.get("pattern"), str):
            patterns.append(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            patterns.extend(node["patternProperties"])
    return patterns


def _takes_pattern(pattern: str) -> bool:
    return _takes(json.dumps({"type": "string", "pattern": pattern}))


@functools.lru_cache(maxsize=1024)
def _takes(schema: str) -> bool:
    """Whether llguidance compiles `schema` (the JSON text of a one-keyword schema)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except Exception:  # noqa: BLE001 - llguidance raises its own types for what it refuses
        return False
    return not llguidance.LLMatcher.validate_grammar(grammar)
