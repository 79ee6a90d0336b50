"""Python-call tool calls (vLLM's "pythonic" parser; Llama 3.2, Llama 4, ToolACE): the whole
output is a list of calls `[get_weather(city="Paris"), now()]`, each argument a keyword whose
value is a Python literal, written back as JSON."""

from __future__ import annotations

import ast
import json
import re
from enum import Enum

from jvllm.entrypoints.openai.tool_parsers.base import ToolParser
from jvllm.entrypoints.openai.tool_parsers.partial_json import skip_whitespace

_CALL_HEAD = re.compile(r"[A-Za-z_]\w*\s*\(")  # a function's name and its `(`
_OPENERS, _CLOSERS = "([{", ")]}"


class _State(Enum):
    START = "start"  # before the list's `[`
    OPEN = "open"  # after `[` or a `,`: a call next
    CALL = "call"  # in a call, up to its `)`
    AFTER = "after"  # after a call: `,` or `]`
    END = "end"  # after the `]`: whitespace only


class PythonicToolParser(ToolParser):
    """Output that is not such a list is all content. A call is sent once its `)` closes it:
    its arguments exist only as a Python expression until then. Values are literals only
    (strings, numbers, True/False/None, lists, dicts with string keys), read from the parsed
    tree and never evaluated; positional arguments are malformed, as the schema names them."""

    def __init__(self, tokenizer=None, tools: dict[str, dict] | None = None):
        super().__init__(tokenizer, tools)
        self._state = _State.START
        self._call = _CallScanner(0)

    def _advance(self, is_final: bool) -> None:
        text = self._text
        while True:
            pos = skip_whitespace(text, self._pos)
            if pos == len(text) and self._state is not _State.CALL:
                if self._state is _State.END:
                    self._drop(pos)
                elif is_final:
                    raise ValueError("the output is not a complete list of tool calls")
                return
            if self._state is _State.START:
                if text[pos] != "[":
                    raise ValueError("the output is not a list of tool calls")
                self._hold(pos + 1)
                self._state = _State.OPEN
            elif self._state is _State.OPEN:
                head = _CALL_HEAD.match(text, pos)
                if head is None:
                    if re.fullmatch(r"[A-Za-z_]\w*\s*", text[pos:]) and not is_final:
                        return  # the name may go on to its `(`
                    raise ValueError("a list of tool calls holds calls `name(...)`")
                self._hold(pos)
                self._call = _CallScanner(head.end())
                self._state = _State.CALL
            elif self._state is _State.CALL:
                end = self._call.scan(text)
                if end is None:
                    if is_final:
                        raise ValueError("the output ends inside a tool call")
                    return
                name, arguments = _call_fields(text[self._pos : end])
                self._send_call(name, arguments, end)
                self._state = _State.AFTER
            elif self._state is _State.AFTER:
                if text[pos] == "]":
                    self._drop(pos + 1)
                    self._state = _State.END
                elif text[pos] == ",":
                    self._hold(pos + 1)
                    self._state = _State.OPEN
                else:
                    raise ValueError("a list of tool calls needs `,` or `]` after a call")
            else:
                raise ValueError("text after the list of tool calls")


class _CallScanner:
    """Finds the `)` that closes a call, over strings and nested brackets, as the text grows.
    It only counts; `ast` parses the closed call and finds what is wrong with it."""

    def __init__(self, pos: int):
        self._pos = pos  # text[:pos] is scanned; text[pos - 1] is the call's `(` at first
        self._depth = 1
        self._quote: str | None = None  # the open string's quote: ', ", ''' or \"\"\"

    def scan(self, text: str) -> int | None:
        """The index after the call's `)`, or None while the text has not closed it."""
        pos = self._pos
        while pos < len(text):
            char = text[pos]
            if self._quote is not None:
                step = self._string_step(text, pos)
                if step is None:
                    break
                pos += step
                continue
            if char in "'\"":
                if text[pos:] in (char, char * 2):
                    break  # a string, empty or not, or a triple quote: the next text tells
                self._quote = char * 3 if text.startswith(char * 3, pos) else char
                pos += len(self._quote)
                continue
            self._depth += (char in _OPENERS) - (char in _CLOSERS)
            pos += 1
            if self._depth == 0:
                self._pos = pos
                return pos
        self._pos = pos
        return None

    def _string_step(self, text: str, pos: int) -> int | None:
        """How far to move in a string at text[pos]; None while the next text decides."""
        quote = self._quote
        if text[pos] == "\\":
            return None if pos + 1 == len(text) else 2
        if text.startswith(quote, pos):
            self._quote = None
            return len(quote)
        if len(quote) == 3 and text[pos] == quote[0] and len(text) - pos < 3:
            return None  # may be the start of the closing triple quote
        return 1


def _call_fields(call_text: str) -> tuple[str, str]:
    """(name, arguments as JSON) of a call's text. Raises ValueError unless it is a call of a
    plain name with keyword arguments whose values are literals."""
    try:
        call = ast.parse(call_text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"a tool call is not Python: {e}") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError("a tool call must be `name(keyword=literal, ...)`")  # noqa: TRY004
    if call.args or any(keyword.arg is None for keyword in call.keywords):
        raise ValueError("a tool call's arguments must be keywords")
    arguments = {keyword.arg: _literal(keyword.value) for keyword in call.keywords}
    if len(arguments) < len(call.keywords):  # Python refuses it; ast.parse does not check
        raise ValueError("a tool call repeats a keyword argument")
    return call.func.id, json.dumps(arguments, ensure_ascii=False)


def _literal(node: ast.expr):
    """The JSON value of a literal's tree, which is never evaluated."""
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (str, int, float))
    ):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.List):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            raise ValueError("a dict in a tool call's arguments needs string keys")
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}
    raise ValueError("a tool call's argument values must be literals")
