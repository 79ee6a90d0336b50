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
import urllib.parse

# Keywords that hold one schema of a value of the object's own (an item, a property's value).
_VALUE_SCHEMA = ("items", "additionalItems", "contains", "propertyNames")
_VALUE_SCHEMA += ("additionalProperties", "unevaluatedItems", "unevaluatedProperties")
# Keywords whose schemas apply to the same instance as the schema holding them.
_COMPOSING_SCHEMA = ("not", "if", "then", "else")
_COMPOSING_LISTS = ("allOf", "anyOf", "oneOf")
# Keywords holding a dict of schemas (its keys are names, not keywords); "enum", "const",
# "default" and "examples" hold data, not schemas.
_SCHEMA_DICTS = ("properties", "patternProperties", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples")
_DEFS = ("$defs", "definitions")
# What an object says of properties it does not list, or that composes it with other schemas.
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties", "$ref")
_OPEN_KEYS += (*_COMPOSING_SCHEMA, *_COMPOSING_LISTS, "dependentSchemas", "dependencies")
# Keywords beside a $ref that add nothing to the instance (pydantic puts its $defs beside a
# root $ref).
_ANNOTATIONS = {"$ref", "title", "description", "default", "examples", "$comment", "deprecated"}
_ANNOTATIONS |= {*_DEFS, "$schema", "$id", "$anchor"}


def close_objects(schema):
    """A copy of `schema` (a dict, or a bool) in which every object that lists its properties,
    says nothing of others and composes no other schema has `"additionalProperties": false`.
    A key such an object requires without listing it becomes a listed key of any value: it was
    one of the others, and closed without it the object would admit nothing.
    A "#/..." $ref names a place in the schema of the nearest `$id` around it (a tool's
    parameters placed inside a larger schema keep theirs). A composed $ref that names its
    target otherwise (an $anchor, an $id) is not followed here: then no object is closed."""
    schema = copy.deepcopy(schema)
    composed_refs: set[str] = set()
    while True:  # a composed $ref's target is composed, and so are the $refs it holds
        nodes = list(_schemas(schema, "#", composed_refs, composed=False))
        resources = [at for node, _, at in nodes if at != "#" and isinstance(node.get("$id"), str)]
        found = {
            _pointer(node["$ref"], _resource(at, resources))
            for node, composed, at in nodes
            if _ref(node) is not None and (composed or set(node) - _ANNOTATIONS)
        }
        if None in found:
            return schema
        if found <= composed_refs:
            break
        composed_refs |= found
    for node, composed, _ in nodes:
        if "properties" in node and not composed and not any(k in node for k in _OPEN_KEYS):
            node["additionalProperties"] = False
            properties, required = node["properties"], node.get("required")
            if isinstance(properties, dict) and isinstance(required, list):
                for name in required:
                    if isinstance(name, str):
                        properties.setdefault(name, {})
    return schema


def each_schema(schema):
    """Every schema dict in `schema`, itself first, not following $refs (data such as "enum"
    or "default" is not walked)."""
    return (node for node, _, _ in _schemas(schema, "#", set(), composed=False))


def rebase_refs(schema, at: str):
    """A copy of `schema` to be placed at JSON pointer `at` ("#/items/...") of a larger schema:
    each $ref that points into `schema` ("#", "#/$defs/A") points to the same place there.
    Data ("enum", "const", "default", "examples") is copied as it is, and so is a schema with
    an `$id`: the $refs in it name places in it, wherever it is placed."""
    if isinstance(schema, list):
        return [rebase_refs(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if isinstance(schema.get("$id"), str):
        return copy.deepcopy(schema)
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            value = at + value[1:]
        elif key in (*_SCHEMA_DICTS, *_DEFS) and isinstance(value, dict):
            value = {name: rebase_refs(item, at) for name, item in value.items()}
        elif key in _DATA:
            value = copy.deepcopy(value)
        else:
            value = rebase_refs(value, at)
        rebased[key] = value
    return rebased


def _schemas(schema, pointer: str, composed_refs: set[str], composed: bool):
    """Every schema dict in `schema` (at JSON pointer `pointer`) with whether it applies beside
    other schemas to the same instance (then its keys are "additional" to theirs) and its
    pointer."""
    if isinstance(schema, list):  # "items" as a list (draft 4-7 tuples)
        for i, item in enumerate(schema):
            yield from _schemas(item, f"{pointer}/{i}", composed_refs, False)
        return
    if not isinstance(schema, dict):
        return
    composed = composed or pointer in composed_refs
    yield schema, composed, pointer
    is_object = "properties" in schema or schema.get("type") == "object"
    for key, value in schema.items():
        at = f"{pointer}/{_escape(key)}"
        if key in _VALUE_SCHEMA:
            yield from _schemas(value, at, composed_refs, False)
        elif key in _COMPOSING_SCHEMA:
            yield from _schemas(value, at, composed_refs, True)
        elif key in _COMPOSING_LISTS and isinstance(value, list):
            # An anyOf's alternatives are whole values, unless they add to the object's own
            # (or to the schemas this one applies beside); so is an allOf's only member under
            # nothing but annotations (pydantic v1's wrapping of a described $ref).
            is_alias = len(value) == 1 and "$ref" not in schema
            is_alias = is_alias and set(schema) <= _ANNOTATIONS | {key}
            beside = composed or is_object or (key == "allOf" and not is_alias)
            for i, item in enumerate(value):
                yield from _schemas(item, f"{at}/{i}", composed_refs, beside)
        elif key == "prefixItems" and isinstance(value, list):
            for i, item in enumerate(value):
                yield from _schemas(item, f"{at}/{i}", composed_refs, False)
        elif key in (*_SCHEMA_DICTS, *_DEFS) and isinstance(value, dict):
            for name, item in value.items():
                yield from _schemas(item, f"{at}/{_escape(name)}", composed_refs, False)


def _escape(key: str) -> str:
    """A key as a JSON pointer's reference token."""
    return str(key).replace("~", "~0").replace("/", "~1")


def _resource(at: str, resources: list[str]) -> str:
    """The pointer of the schema whose `$id` is nearest around the one at `at` ("#": the
    root, which its $refs name places in whether it has an $id or not)."""
    around = [r for r in resources if at == r or at.startswith(r + "/")]
    return max(around, key=len, default="#")


def _pointer(ref: str, resource: str = "#") -> str | None:
    """The JSON pointer into this document that a $ref in the schema at `resource` names
    ("#/$defs/A", percent-encoded or not), else None."""
    if ref == "#" or ref.startswith("#/"):
        return resource + urllib.parse.unquote(ref)[1:]
    return None


def _ref(node) -> str | None:
    ref = node.get("$ref") if isinstance(node, dict) else None
    return ref if isinstance(ref, str) else None
