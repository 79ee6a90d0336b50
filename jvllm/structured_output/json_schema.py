"""JSON schemas with their objects closed: an object that lists its properties gets no others.

JSON Schema leaves objects open, and llguidance follows it, so a small model fills an object
with keys it never declared until max_tokens cuts the JSON short (the default model, sampled:
6 of 6 outputs). vLLM's default grammar backend (xgrammar, strict) emits only the declared
keys. Closing is safe only where all of an object's properties are listed in one place: an
object that composes others (allOf, anyOf or oneOf beside its own properties, a $ref beside its
own keys, if/then/else) stays open, and so do the schemas it composes and the $defs they refer
to, since each one's keys are "additional" to the others'.
"""

import copy

# Keywords that hold one schema of a value of the object's own (an item, a property's value).
_VALUE_SCHEMA = ("items", "additionalItems", "contains", "propertyNames")
_VALUE_SCHEMA += ("additionalProperties", "unevaluatedItems", "unevaluatedProperties")
# Keywords whose schemas apply to the same instance as the schema holding them.
_COMPOSING_SCHEMA = ("not", "if", "then", "else")
_COMPOSING_LISTS = ("allOf", "anyOf", "oneOf")
# Keywords holding a dict of schemas (its keys are names, not keywords); "enum", "const",
# "default" and "examples" hold data, not schemas.
_SCHEMA_DICTS = ("properties", "patternProperties", "dependentSchemas")
_DEFS = ("$defs", "definitions")
# What an object says of properties it does not list, or that composes it with other schemas.
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties", "$ref")
_OPEN_KEYS += (*_COMPOSING_SCHEMA, *_COMPOSING_LISTS, "dependentSchemas", "dependencies")
# Keywords beside a $ref that add nothing to the instance.
_ANNOTATIONS = {"$ref", "title", "description", "default", "examples", "$comment", "deprecated"}


def close_objects(schema):
    """A copy of `schema` (a dict, or a bool) in which every object that lists its properties,
    says nothing of others and composes no other schema has `"additionalProperties": false`."""
    schema = copy.deepcopy(schema)
    _close(schema, _composed_refs(schema), composed=False)
    return schema


def _close(schema, composed_refs: set[str], composed: bool) -> None:
    """Close `schema`'s objects in place; `composed`: `schema` applies beside others."""
    if isinstance(schema, list):  # "items" as a list (draft 4-7 tuples)
        for item in schema:
            _close(item, composed_refs, False)
        return
    if not isinstance(schema, dict):
        return
    lists_properties = "properties" in schema
    if lists_properties and not composed and not any(k in schema for k in _OPEN_KEYS):
        schema["additionalProperties"] = False
    is_object = lists_properties or schema.get("type") == "object"
    for key, value in schema.items():
        if key in _VALUE_SCHEMA:
            _close(value, composed_refs, False)
        elif key in _COMPOSING_SCHEMA:
            _close(value, composed_refs, True)
        elif key in _COMPOSING_LISTS and isinstance(value, list):
            # An anyOf's alternatives are whole values, unless they add to the object's own.
            for item in value:
                _close(item, composed_refs, key == "allOf" or is_object)
        elif key == "prefixItems" and isinstance(value, list):
            for item in value:
                _close(item, composed_refs, False)
        elif key in _SCHEMA_DICTS and isinstance(value, dict):
            for item in value.values():
                _close(item, composed_refs, False)
        elif key in _DEFS and isinstance(value, dict):
            for name, item in value.items():
                _close(item, composed_refs, f"#/{key}/{name}" in composed_refs)


def _composed_refs(schema) -> set[str]:
    """The $refs whose targets apply beside other schemas: members of an allOf, of an object's
    anyOf or oneOf, and a $ref beside keywords of its own."""
    refs = set()
    for node in _dicts(schema):
        is_object = "properties" in node or node.get("type") == "object"
        for key in _COMPOSING_LISTS:
            members = node.get(key)
            if isinstance(members, list) and (key == "allOf" or is_object):
                refs.update(_ref(m) for m in members if _ref(m) is not None)
        if _ref(node) is not None and set(node) - _ANNOTATIONS:
            refs.add(node["$ref"])
    return refs


def _ref(node) -> str | None:
    ref = node.get("$ref") if isinstance(node, dict) else None
    return ref if isinstance(ref, str) else None


def _dicts(value):
    """Every dict in a JSON value, itself included."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _dicts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _dicts(item)
