"""Structured outputs on the default model: what comes back matches its constraint, greedy and
sampled, and requests without one are untouched by those with one."""

import decimal
import enum
import json
import pathlib
import re
import types
from typing import Annotated, Literal

import jsonschema
import numpy as np
import pydantic
import pytest

from jvllm import LLM, SamplingParams, StructuredOutputsParams
from jvllm.structured_output.grammar import cache_key, validate
from jvllm.structured_output.json_schema import close_objects, rebase_refs
from jvllm.structured_output.schema_support import supported

# Every leaf has a bounded length (strings, integers) so that sampled outputs close in time
# on any CPU; a bounded number may still have any number of decimals, so it is tested greedy.
_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_SMALL_INT = {"type": "integer", "minimum": -1000, "maximum": 1000}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"name": _NAME, "age": _SMALL_INT},
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "city": _NAME,
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": _NAME, "minItems": 2, "maxItems": 3}},
        "required": ["colors"],
        "additionalProperties": False,
    },
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "size": {"enum": ["small", "medium", "large"]},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": 3, "maximum": 7},
        },
        "required": ["size", "score", "count"],
        "additionalProperties": False,
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": _SMALL_INT, "y": _SMALL_INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
}
PROMPT = "Answer with a JSON object describing something: "
ARITHMETIC = """start: "(" NUMBER OP NUMBER ")" OP NUMBER
OP: "+" | "-" | "*"
NUMBER: /[1-9][0-9]{0,2}/
"""


def _params(temperature: float, **constraint) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=7,
        max_tokens=96,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_outputs_validate_against_their_schemas(smollm2_llm, temperature):
    names = [n for n in SCHEMAS if temperature == 0 or n != "enum_and_bounds"]
    # Sampled JSON is asked compact: free whitespace lets a sampled small model idle in it.
    params = [
        _params(temperature, json=SCHEMAS[n], disable_any_whitespace=temperature > 0) for n in names
    ]
    outputs = smollm2_llm.generate([PROMPT] * len(names), params, use_tqdm=False)
    for name, output in zip(names, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])


def test_objects_get_no_properties_their_schema_does_not_list(smollm2_llm):
    """A schema that leaves additionalProperties unsaid gets only its declared keys, as from
    vLLM's default (strict) grammar backend; sampled, a small model otherwise adds keys until
    max_tokens cuts the JSON short."""
    open_schema = {
        "type": "object",
        "properties": {
            "name": _NAME,
            "age": _SMALL_INT,
            "pet": {"type": "object", "properties": {"kind": _NAME}},
        },
        "required": ["name", "age"],
    }
    params = [
        SamplingParams(
            temperature=0.8,
            seed=seed,
            max_tokens=80,
            structured_outputs=StructuredOutputsParams(json=open_schema),
        )
        for seed in range(4)
    ]
    outputs = smollm2_llm.generate(["Describe a person as JSON: "] * 4, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        jsonschema.validate(value, open_schema)
        assert set(value) <= {"name", "age", "pet"}, completion.text
        assert set(value.get("pet", {})) <= {"kind"}, completion.text


def test_closing_objects_leaves_data_explicit_settings_and_composed_objects_open():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    base = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    schema = {
        "$defs": {"point": point, "base": base},
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {}}},  # a key named so
            "list": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/point"}, point]}},
            "open": {"type": "object", "properties": {"b": {}}, "additionalProperties": True},
            "bare": {"type": "object"},
            "both": {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"y": {}}}]},
        },
        "default": {"properties": {"z": 1}},
    }
    closed = close_objects(schema)
    props = closed["properties"]
    assert "additionalProperties" not in schema  # a copy
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert props["list"]["items"]["anyOf"][1]["additionalProperties"] is False  # alternatives
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["bare"]  # lists no properties: any object
    assert "additionalProperties" not in props["both"]["allOf"][1]
    assert "additionalProperties" not in closed["$defs"]["base"]  # an allOf member's target
    assert closed["default"] == schema["default"]  # data, not a schema


_BASE = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
_NAME_REQUIRED = {"properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        (
            {"$defs": {"Base": _BASE}, "allOf": [{"$ref": "#/$defs/Base"}, _NAME_REQUIRED]},
            {"id": 1, "name": "a"},
        ),
        (
            {"$defs": {"Base": _BASE}, "$ref": "#/$defs/Base", **_NAME_REQUIRED},
            {"id": 1, "name": "a"},
        ),
        (
            {
                "type": "object",
                "properties": {"kind": {"type": "string"}, "a": {}, "b": {}},
                "oneOf": [  # exclusive only through "kind": taken as an anyOf
                    {"properties": {"kind": {"const": "A"}}, "required": ["a"]},
                    {"properties": {"kind": {"const": "B"}}, "required": ["b"]},
                ],
            },
            {"kind": "A", "a": 1},
        ),
        (
            {"type": "object", "anyOf": [{"properties": {"a": {}}, "required": ["a"]}, _BASE]},
            {"a": 1, "id": 2},
        ),
        (
            {  # an anyOf inside an allOf member applies beside the other members too
                "type": "object",
                "allOf": [
                    {"anyOf": [{"properties": {"a": {}}, "required": ["a"]}, _NAME_REQUIRED]},
                    _BASE,
                ],
            },
            {"a": 1, "id": 2},
        ),
        (
            {  # a $def that only refers on: its target is composed too
                "$defs": {"Alias": {"$ref": "#/$defs/Base"}, "Base": _BASE},
                "allOf": [{"$ref": "#/$defs/Alias"}, _NAME_REQUIRED],
            },
            {"id": 1, "name": "a"},
        ),
        (  # composed $refs that are not plain JSON pointers: percent-encoded, an $anchor
            {"$defs": {"Base": _BASE}, "allOf": [{"$ref": "#/%24defs/Base"}, _NAME_REQUIRED]},
            {"id": 1, "name": "a"},
        ),
        (
            {
                "$defs": {"Base": {"$anchor": "base", **_BASE}},
                "allOf": [{"$ref": "#base"}, _NAME_REQUIRED],
            },
            {"id": 1, "name": "a"},
        ),
        ({"type": "object", "required": ["x"]}, {"x": 1, "y": 2}),
        ("true", 5),
    ],
)
def test_schemas_that_compose_objects_stay_satisfiable(schema, instance):
    """Closing an object whose properties other schemas add to would leave nothing to emit."""
    closed = close_objects(json.loads(schema) if isinstance(schema, str) else schema)
    jsonschema.validate(instance, closed)
    validate(StructuredOutputsParams(json=schema))


def test_refs_that_only_name_a_schema_close_its_target():
    """pydantic's schema of a recursive model: $defs beside the root $ref add no keys; nor do
    annotations beside an allOf of one $ref (pydantic v1)."""
    node = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"items": {"$ref": "#/$defs/N"}}},
    }
    closed = close_objects({"$defs": {"N": node}, "$ref": "#/$defs/N"})
    assert closed["$defs"]["N"]["additionalProperties"] is False
    # pydantic v1's field of a model type with a description: an allOf of that one $ref.
    field = {"description": "a node", "default": None, "allOf": [{"$ref": "#/definitions/N"}]}
    v1 = {"type": "object", "properties": {"n": field}, "definitions": {"N": node}}
    assert close_objects(v1)["definitions"]["N"]["additionalProperties"] is False
    # An $anchor named by a $ref that composes nothing: its target closes as well.
    anchored = {"$defs": {"N": {"$anchor": "n", **node}}, "items": {"$ref": "#n"}}
    assert close_objects(anchored)["$defs"]["N"]["additionalProperties"] is False


def test_a_required_key_the_object_does_not_list_stays_allowed_when_closed():
    """Closed as it was, {"properties": {"a"}, "required": ["a", "b"]} admitted nothing and
    was refused as unsatisfiable; "b" is now a listed key of any value."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    closed = close_objects(schema)
    assert closed["properties"] == {"a": {"type": "integer"}, "b": {}}
    assert closed["additionalProperties"] is False
    jsonschema.validate({"a": 1, "b": [2]}, closed)
    validate(StructuredOutputsParams(json=schema))


def test_refs_of_a_schema_placed_inside_another_point_where_it_now_is():
    schema = {
        "$defs": {"A": {"type": "integer"}},
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "self": {"$ref": "#"},
            "default": {"$ref": "#/$defs/A"},  # a property so named: a schema, not data
            "url": {"$ref": "https://example.com/a.json"},
        },
        "default": {"$ref": "#/$defs/A"},  # data
    }
    rebased = rebase_refs(schema, "#/items/0")
    refs = {name: value["$ref"] for name, value in rebased["properties"].items()}
    assert refs == {
        "a": "#/items/0/$defs/A",
        "self": "#/items/0",
        "default": "#/items/0/$defs/A",
        "url": "https://example.com/a.json",
    }
    assert rebased["default"] == schema["default"]
    assert schema["properties"]["a"]["$ref"] == "#/$defs/A"  # a copy


def test_formats_llguidance_does_not_know_are_annotations(smollm2_llm):
    """pydantic's Path, bytes and SecretStr carry formats ("path", "binary", "password") that
    llguidance refused as unknown; JSON Schema 2020-12 makes a format an annotation, so they
    now hold any string."""

    class Upload(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        path: Annotated[pathlib.Path, pydantic.Field(max_length=12)]
        data: Annotated[bytes, pydantic.Field(max_length=8)]
        token: Annotated[pydantic.SecretStr, pydantic.Field(max_length=8)]

    schema = Upload.model_json_schema()
    assert {p["format"] for p in schema["properties"].values()} == {"path", "binary", "password"}
    params = _params(0.0, json=schema, disable_any_whitespace=True)
    [output] = smollm2_llm.generate(["An upload as JSON: "], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
    jsonschema.validate(json.loads(output.outputs[0].text), schema)
    date = {"type": "string", "format": "date"}  # one llguidance knows is kept
    assert supported(dict(date)) == date


def test_a_decimal_field_runs_as_a_number(smollm2_llm):
    """pydantic's Decimal is anyOf a number or a string whose pattern has a look-ahead, which
    llguidance cannot compile: the whole schema was refused. The alternative llguidance
    cannot take is dropped while another remains."""

    class Price(pydantic.BaseModel):
        amount: decimal.Decimal = pydantic.Field(ge=0, le=100)
        currency: Literal["EUR", "USD"]

    schema = Price.model_json_schema()
    assert "(?!" in schema["properties"]["amount"]["anyOf"][1]["pattern"]
    params = _params(0.0, json=schema, disable_any_whitespace=True)
    [output] = smollm2_llm.generate(["A price as JSON: "], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
    value = json.loads(output.outputs[0].text)
    jsonschema.validate(value, schema)
    assert isinstance(value["amount"], (int, float))
    with pytest.raises(ValueError, match="look-around"):  # with no other alternative
        validate(StructuredOutputsParams(json={"anyOf": [{"type": "string", "pattern": "(?!a)"}]}))


def test_a_dict_keyed_by_a_literal_or_an_enum_takes_those_keys(smollm2_llm):
    """pydantic's dict[Literal[...], X] and dict[SomeEnum, X] name their keys in propertyNames,
    which llguidance does not implement (a ValueError): they run as optional properties."""

    class Size(str, enum.Enum):
        small = "small"
        large = "large"

    class Stock(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        by_color: dict[Literal["red", "blue"], Annotated[int, pydantic.Field(ge=0, le=9)]]
        by_size: dict[Size, bool]

    schema = Stock.model_json_schema()
    assert "propertyNames" in schema["properties"]["by_size"]
    params = _params(0.0, json=schema, disable_any_whitespace=True)
    [output] = smollm2_llm.generate(["Stock as JSON: "], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
    jsonschema.validate(json.loads(output.outputs[0].text), schema)
    with pytest.raises(ValueError, match="propertyNames"):  # names by a pattern: refused
        validate(StructuredOutputsParams(json={"propertyNames": {"pattern": "^a"}}))


def test_the_false_schema_is_refused_and_key_order_is_kept():
    with pytest.raises(ValueError, match="false accepts no value"):
        validate(StructuredOutputsParams(json="false"))
    first = {"type": "object", "properties": {"zeta": {}, "alpha": {}}}
    second = {"type": "object", "properties": {"alpha": {}, "zeta": {}}}
    keys = {cache_key(StructuredOutputsParams(json=s)) for s in (first, second)}
    assert len(keys) == 2  # each compiles its own grammar, in its own order


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_regex_choice_grammar_and_json_object_are_obeyed(smollm2_llm, temperature):
    cases = [
        ("A phone number: ", {"regex": r"\d{3}-\d{3}-\d{4}"}),
        ("Is the sky blue? ", {"choice": ["yes", "no", "maybe so"]}),
        ("Some arithmetic: ", {"grammar": ARITHMETIC}),
    ]
    if temperature == 0:  # any JSON object, sampled from a small model, rarely closes
        cases.append(("A JSON object:", {"json_object": True}))
    outputs = smollm2_llm.generate(
        [p for p, _ in cases], [_params(temperature, **c) for _, c in cases], use_tqdm=False
    )
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", texts[0])
    assert texts[1] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\(\d+[-+*]\d+\)[-+*]\d+", texts[2])
    assert isinstance(eval(texts[2]), int)  # the grammar allows arithmetic only
    if temperature == 0:
        assert isinstance(json.loads(texts[3]), dict)


@pytest.mark.parametrize("kind", ["choice", "grammar"])
def test_thousands_of_alternatives_sharing_a_first_token_are_obeyed(smollm2_llm, kind):
    """More alternatives than llguidance's parser held in a row by default (2000): the mask
    allowed "option", and consuming it failed, which aborted the request. A choice is one
    lexer terminal; a GBNF rule of 3000 alternatives runs under the raised limit."""
    choice = [f"option {i}" for i in range(3000)]
    if kind == "choice":
        params = [_params(t, choice=choice) for t in (0.0, 0.8)]
    else:
        gbnf = "root ::= " + " | ".join(f'"{c}"' for c in choice)
        params = [_params(t, grammar=gbnf) for t in (0.0, 0.8)]
    outputs = smollm2_llm.generate(["Pick one: "] * 2, params, use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        assert output.outputs[0].text in choice


def test_a_token_the_grammar_rejects_aborts_saying_why(smollm2_llm):
    """The abort names llguidance's reason for refusing the token."""
    from jvllm.structured_output.manager import GrammarState

    manager = smollm2_llm.llm_engine.structured_outputs
    template = manager.compile(StructuredOutputsParams(grammar='start: "yes" | "no"'))
    template.result(timeout=30)
    state = GrammarState(template)
    assert state.is_ready()
    maybe = smollm2_llm.get_tokenizer().encode("maybe", add_special_tokens=False)
    assert not state.accept(maybe[0])
    assert state.error.startswith(f"the grammar rejected token {maybe[0]}: ")
    assert "doesn't satisfy the grammar" in state.error


def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(smollm2_llm):
    free = ["The capital of France is", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = smollm2_llm.generate(free, greedy, use_tqdm=False)
    constrained = _params(0.0, json=SCHEMAS["nested"])
    mixed = smollm2_llm.generate(
        [PROMPT, free[0], PROMPT, free[1]],
        [constrained, greedy, constrained, greedy],
        use_tqdm=False,
    )
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == [
        a.outputs[0].token_ids for a in alone
    ]
    assert mixed[0].outputs[0].text == mixed[2].outputs[0].text  # batch-invariant greedy


def test_n_seeds_and_logprobs_work_with_a_constraint(smollm2_llm):
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=3,
        max_tokens=8,
        logprobs=2,
        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]),
    )
    first = smollm2_llm.generate(["My favourite colour is "], params, use_tqdm=False)[0]
    again = smollm2_llm.generate(["My favourite colour is "], params, use_tqdm=False)[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    for completion in first.outputs:
        assert completion.text in ("red", "green", "blue")
        # Logprobs are the raw model's (vLLM's default): the sampled token is among them.
        assert len(completion.logprobs) == len(completion.token_ids)
        assert completion.token_ids[0] in completion.logprobs[0]


def test_constrained_outputs_survive_preemption_windows_and_async_steps(tiny_llama_dir):
    """A pool too small for the batch preempts requests mid-JSON (their matchers keep their
    place), and an engine with decode windows and async scheduling runs constrained requests in
    single steps: both give the tokens of a plain engine."""
    prompts = [f"{PROMPT}{i}" for i in range(5)]
    params = _params(0.0, json=SCHEMAS["array"], disable_any_whitespace=True)
    kwargs = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 8}

    def run(**extra) -> tuple[list[list[int]], LLM]:
        llm = LLM(tiny_llama_dir, **kwargs, **extra)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for output in outputs:
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS["array"])
        return [o.outputs[0].token_ids for o in outputs], llm

    expected, _ = run(num_gpu_blocks_override=200)
    tokens, tight = run(num_gpu_blocks_override=10)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected
    tokens, _ = run(num_gpu_blocks_override=200, num_scheduler_steps=4, async_scheduling=True)
    assert tokens == expected


@pytest.mark.slow  # two engines of a 49152-token vocabulary: 28 s on 2 cores
def test_drafts_are_verified_against_the_grammar_at_each_position(tiny_llama_dir):
    """n-gram speculation on constrained requests: drafts the grammar rejects are cut before
    the step, and each draft position samples under its own mask (the grammar advanced over
    the drafts before it), so greedy and seeded sampled texts equal a plain engine's."""
    regex = "(( the)|( of)|( and)|( to)|( a)){1,40}"
    so = StructuredOutputsParams(regex=regex)
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=24, structured_outputs=so)
        for t in (0.0, 0.8)
        for s in (1, 2)
    ]
    kwargs = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 8}
    prompts = [[5, 6, 7]] * len(params)
    plain = LLM(tiny_llama_dir, **kwargs).generate(prompts, params, use_tqdm=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = LLM(tiny_llama_dir, speculative_config=ngram, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    for output in outputs:
        assert re.fullmatch(regex, output.outputs[0].text), output.outputs[0].text
    assert llm.llm_engine.spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        # Valid to llguidance, but they admit only the empty text.
        ({"grammar": "root ::= "}, "structured_outputs.grammar: the grammar is empty"),
        ({"grammar": "start: "}, "structured_outputs.grammar: the grammar is empty"),
        ({"regex": "()"}, "structured_outputs.regex: it admits only the empty text"),
    ],
)
def test_invalid_constraints_are_refused_before_entering_the_engine(
    smollm2_llm, constraint, message
):
    engine = smollm2_llm.llm_engine
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", "Hello", params)
    assert not engine.has_unfinished_requests()


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    params = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert params.structured_outputs.kind == "regex"


@pytest.mark.parametrize("schema", [{"enum": {1, 2}}, {"const": float("nan")}])
def test_a_schema_that_is_not_json_data_is_a_value_error(schema):
    """A set was a TypeError from deep in add_request, and NaN went through to llguidance."""
    with pytest.raises(ValueError, match="structured_outputs.json must be JSON data"):
        StructuredOutputsParams(json=schema)


def test_mask_agrees_with_the_matcher_on_random_token_walks(smollm2_llm):
    """The device's unpacked mask allows exactly the tokens llguidance's matcher accepts, along
    random walks through a schema (at each step a random allowed token is taken)."""
    import jax
    import jax.numpy as jnp
    import llguidance

    from jvllm.sample.sampler import apply_token_bitmask
    from jvllm.structured_output.manager import GrammarState

    engine = smollm2_llm.llm_engine
    manager, vocab = engine.structured_outputs, engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    apply = jax.jit(apply_token_bitmask)
    for name in ("nested", "enum_and_bounds"):
        template = manager.compile(StructuredOutputsParams(json=SCHEMAS[name]))
        state = GrammarState(template)
        template.result(timeout=30)
        assert state.is_ready()
        reference: llguidance.LLMatcher = state.matcher.deep_copy()
        for _ in range(12):
            mask = manager.bitmask([_Constrained(state)], lambda r: True)
            masked = apply(jnp.zeros((1, vocab)), mask)
            allowed = np.flatnonzero(np.isfinite(np.asarray(masked[0])))
            some_allowed = rng.choice(allowed, min(len(allowed), 100), replace=False)
            probe = np.unique(np.concatenate([some_allowed, rng.integers(0, vocab, 200)]))
            accepted = [t for t in probe.tolist() if reference.validate_tokens([t]) == 1]
            assert np.intersect1d(probe, allowed).tolist() == accepted
            token = int(rng.choice(allowed))
            assert state.accept(token) and reference.consume_token(token)
            if state.is_terminated:
                break


def test_draft_positions_are_masked_by_the_grammar_advanced_over_the_drafts_before(
    smollm2_llm,
):
    """Speculative decoding's masks: after the request's own row (its bonus token's, past
    every draft) one row per draft position, each the mask with the drafts before it taken;
    the request's matcher is left where it was."""
    from jvllm.structured_output.manager import GrammarState

    manager = smollm2_llm.llm_engine.structured_outputs
    template = manager.compile(StructuredOutputsParams(json=SCHEMAS["nested"]))
    template.result(timeout=30)
    state = GrammarState(template)
    assert state.is_ready()
    request = _Constrained(state)
    walker = state.matcher.deep_copy()
    masks, drafts = [], []  # the mask at each position of a walk of allowed tokens
    for _ in range(4):
        walking = _Constrained(types.SimpleNamespace(matcher=walker))
        masks.append(manager.bitmask([walking], lambda r: True)[0])
        bits = (masks[-1][:, None] >> np.arange(32)) & 1
        drafts.append(int(np.flatnonzero(bits.reshape(-1))[-1]))  # its last allowed token
        assert walker.consume_token(drafts[-1])
    drafts.pop()  # the 4th position is the bonus's
    mask = manager.bitmask([request], lambda r: True, {"r": drafts})
    assert mask.shape == (1 + len(drafts), manager.num_words)
    np.testing.assert_array_equal(mask[0], masks[-1])
    np.testing.assert_array_equal(mask[1:], np.stack(masks[:-1]))
    np.testing.assert_array_equal(manager.bitmask([request], lambda r: True)[0], masks[0])
    assert state.num_valid(drafts) == len(drafts)


class _Constrained:
    def __init__(self, state):
        self.request_id = "r"
        self.structured_output = state
