"""JSON schemas rewritten where llguidance would refuse a part that JSON Schema lets go.

Each rewrite keeps every value the grammar then admits valid under the schema as it came:
- a string `format` llguidance does not know (pydantic's "path", "binary", "password",
  "ipvanyaddress", ...) is dropped: JSON Schema 2020-12 makes `format` an annotation unless a
  validator opts in, so any string is valid;
- an `anyOf` alternative whose `pattern` llguidance cannot compile (a look-around, a
  backreference) is dropped while another alternative remains: pydantic's `Decimal` is a number
  or a string matched by a look-ahead, and the number alone is still valid;
- `propertyNames` that lists the names (an `enum` or `const` of strings, or a $ref to one:
  pydantic's `dict[Literal[...], X]` or `dict[SomeEnum, X]`) on an object that lists no
  properties becomes those names as optional properties, each of the `additionalProperties`
  schema, and no others.
"""

import functools
import json
import urllib.parse

import llguidance

from jvllm.structured_output.json_schema import each_schema


def supported(schema):
    """`schema` (a dict, already a private copy) with the rewrites above made in place."""
    for node in each_schema(schema):
        names = _names(schema, node.get("propertyNames"))
        if names is not None and not {"properties", "patternProperties"} & set(node):
            value = node.get("additionalProperties", True)
            node["properties"] = {name: value for name in names}
            node["additionalProperties"] = False
            del node["propertyNames"]
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


def _names(root, schema) -> list[str] | None:
    """The names a `propertyNames` schema lists (following a "#/..." $ref), else None."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref.startswith("#/") and set(schema) <= {"$ref", "title"}:
        schema = root
        for token in ref[2:].split("/"):
            token = urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")
            schema = schema.get(token) if isinstance(schema, dict) else None
    if not isinstance(schema, dict):
        return None
    names = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return list(dict.fromkeys(names))


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
