"""JSON read token by token from a growing text, re-serialised in one canonical form.

A tool call's `arguments` is the model's JSON written back as `json.dumps(value,
ensure_ascii=False)` writes it. Serialising token by token gives the same text, so the streamed
pieces of a call's arguments are prefixes of the whole-response string: a token is emitted only
once it is complete (a string's characters once no pending escape can still change them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# json.loads's grammar: the characters a string holds as they are, and its escapes.
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")
# A \uD800-\uDBFF escape pairs with a following low surrogate into one character.
_HIGH_SURROGATE_TAIL = re.compile(r"(\\+)u[dD][89abAB][0-9a-fA-F]{2}$")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]+")
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# json.loads also takes NaN and the infinities; json.dumps writes them back the same way.
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_PUNCTUATION = {"{": "{", "}": "}", "[": "[", "]": "]", ",": ", ", ":": ": "}


class Pairs(list):
    """A JSON object as its (key, value) pairs in the model's order, repeated keys kept, so
    re-serialising never drops a key that streaming has already sent."""


def loads(text: str):
    """json.loads, with objects as `Pairs`."""
    return json.loads(text, object_pairs_hook=Pairs)


def dumps(value) -> str:
    """The canonical text of a value from `loads`: json.dumps(..., ensure_ascii=False)'s."""
    if isinstance(value, Pairs):
        return "{" + ", ".join(f"{dumps(k)}: {dumps(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Token:
    kind: str  # one of "{}[],:", "string" or "scalar"
    text: str  # canonical
    value: object  # the decoded string, for kind "string"
    end: int  # index after the token in the source text


def skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def scan_token(text: str, pos: int) -> Token | None:
    """The token starting at text[pos] (not whitespace); None while text may still complete it.
    Raises ValueError where no continuation makes it JSON."""
    char = text[pos]
    if char in _PUNCTUATION:
        return Token(char, _PUNCTUATION[char], None, pos + 1)
    if char == '"':
        end, canonical, is_closed = read_string(text, pos + 1)
        if not is_closed:
            return None
        return Token("string", '"' + canonical, json.loads(text[pos:end]), end)
    num_left = len(text) - pos
    for literal in _LITERALS:
        if text.startswith(literal, pos):
            return Token("scalar", literal, None, pos + len(literal))
        if num_left < len(literal) and literal.startswith(text[pos:]):
            return None
    match = _NUMBER_CHARS.match(text, pos)
    if match is None:
        raise ValueError(f"unexpected {char!r} in JSON at {pos}")
    if match.end() == len(text):
        return None  # more digits may follow
    if not _NUMBER.fullmatch(match.group()):
        raise ValueError(f"invalid JSON number {match.group()!r} at {pos}")
    return Token("scalar", dumps(json.loads(match.group())), None, match.end())


def read_string(text: str, pos: int) -> tuple[int, str, bool]:
    """Reads a string from text[pos], inside it between two of its characters, as far as no
    later text can change it, so a long string is read piece by piece as it grows.

    Returns (where reading stopped, the canonical text of what was read, whether that took in
    the closing quote). Raises ValueError where text cannot go on as a JSON string.
    """
    end = _STRING_BODY.match(text, pos).end()
    if end < len(text) and text[end] == '"':
        return end + 1, dumps(json.loads(f'"{text[pos:end]}"'))[1:], True
    if end < len(text) and not _PARTIAL_ESCAPE.fullmatch(text, end):
        raise ValueError(f"invalid character in a JSON string at {end}")
    tail = _HIGH_SURROGATE_TAIL.search(text, pos, end)
    if tail is not None and len(tail.group(1)) % 2 == 1:  # an escape, not an escaped backslash
        end = tail.end(1) - 1
    return end, dumps(json.loads(f'"{text[pos:end]}"'))[1:-1], False
