"""A request's constraint as an llguidance grammar, checked at the edge.

llguidance (not xgrammar) because it needs no torch at run time, fills packed int32 bitmasks
straight into NumPy arrays, takes JSON schemas, regexes and Lark grammars (GBNF too), and
builds a grammar lazily, so a new schema costs well under a millisecond to start.
"""

import functools
import json

import llguidance
import llguidance.numpy

from jvllm.sampling_params import StructuredOutputsParams
from jvllm.structured_output.json_schema import close_objects
from jvllm.structured_output.schema_support import supported

# `json_object=True`: any JSON object, as vLLM asks of its grammar backends.
_ANY_OBJECT = '{"type": "object"}'
# Whitespace allowed between JSON tokens: free, as vLLM's, but at most 32 characters a gap
# (indentation 7 levels deep). Unbounded, a small model can pad the end of an object with
# newlines until max_tokens (BENCHMARKS.md, "Structured outputs": 8% of outputs valid, 92%
# with the bound).
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits, but for its parser's items a row: 2000 by default, so a rule of
    more alternatives than that sharing a first token (a GBNF list of names, say) passed every
    check, let the token through the first mask, then failed the request when it was sampled.
    50,000 is llguidance's own cap on the items of one step (what such masks cost:
    docs/structured_outputs.md)."""
    return llguidance.LLParserLimits(max_items_in_row=50_000)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (a JSON string) of one constraint; unchecked (see `validate`)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _ANY_OBJECT if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if schema is False:
            raise ValueError("the JSON schema false accepts no value at all")
        if schema is True:
            schema = {}  # any value
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object (or true)")
        if kind == "json":
            schema = supported(close_objects(schema))
        # A oneOf whose branches llguidance cannot prove exclusive runs as an anyOf, as
        # vLLM's default backend (xgrammar) takes every oneOf; refused otherwise.
        defaults = {"coerce_one_of": True}
        if params.disable_any_whitespace:
            defaults["whitespace_flexible"] = False
        else:
            defaults["whitespace_pattern"] = _JSON_WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)


def _choice_lark(choice: list[str]) -> str:
    """The choices as one terminal, which the lexer matches as one automaton. llguidance's own
    "choice" grammar makes each a parser alternative, and its parser holds at most 2000 items a
    row: with more choices than that sharing a first token, the mask allowed that token and
    consuming it failed."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def cache_key(params: StructuredOutputsParams) -> str:
    """Requests with equal keys share one compiled grammar. Key order counts: a schema's
    properties come out in the order it lists them."""
    value = getattr(params, params.kind)
    return json.dumps([params.kind, value, params.disable_any_whitespace], ensure_ascii=False)


def validate(params: StructuredOutputsParams) -> str:
    """The grammar of `params` after llguidance has checked it; raises ValueError that says
    what is wrong (an invalid schema, regex or grammar) before the request enters the engine."""
    try:
        grammar = grammar_text(params)
    except Exception as e:  # noqa: BLE001 - llguidance raises its own types for bad input
        raise ValueError(f"invalid structured_outputs.{params.kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise ValueError(f"invalid structured_outputs.{params.kind}: {error.strip()}")
    if _admits_only_empty_text(grammar):
        subject = "it"
        if params.kind == "grammar":
            subject = "the grammar is empty (a root rule with no body, as 'root ::= '?): it"
        raise ValueError(
            f"invalid structured_outputs.{params.kind}: {subject} admits only the empty text, "
            "so the request could generate nothing"
        )
    return grammar


class _ByteVocabulary:
    """One token a byte, then an EOS: any text a grammar admits is a sequence of them."""

    eos_token_id = 256
    bos_token_id = None
    tokens = (*(bytes([b]) for b in range(256)), b"<eos>")
    special_token_ids = (256,)

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def _admits_only_empty_text(grammar: str) -> bool:
    """Whether a (valid) grammar lets no first byte through, only the end: an empty or rule-less
    grammar, which llguidance takes, but under which a request generates nothing."""
    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    mask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)  # i32[1, 9]
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    return not mask[0, : 256 // 32].any()
