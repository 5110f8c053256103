"""Structured output's schema check (planner_svc/json_grammar.py), alone: xgrammar over a one-token vocabulary
(its end) stands in for the model's tokenizer, grammars checked on whole strings."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar

from planner_svc.json_grammar import SchemaCompiler

END = 0  # the one token of the stand-in vocabulary


@pytest.fixture(scope="module")
def xgrammar_compiler():
    info = xgrammar.TokenizerInfo(["</s>"], stop_token_ids=[END])
    return xgrammar.GrammarCompiler(info, cache_enabled=False)


@pytest.fixture
def schemas(xgrammar_compiler):
    checker = SchemaCompiler(None, 1)
    checker._compiler = xgrammar_compiler  # no tokenizer: the stand-in vocabulary
    return checker


def refusal(schemas: SchemaCompiler, schema: dict) -> str:
    return schemas.error(json.dumps(schema)) or ""


def grammar_takes(compiler, schema: dict, text: str) -> bool:
    """Whether xgrammar's strict grammar of `schema` takes `text` as a whole value."""
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), strict_mode=True))
    return matcher.accept_string(text) and matcher.accept_token(END) and matcher.is_terminated()


def test_unsupported_keywords_are_found_with_where_they_are(schemas):
    assert schemas.error(json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})) is None
    assert refusal(schemas, {"not": {}}) == "uses 'not' (at #), which structured output does not enforce"
    nested = {
        "properties": {"xs": {"type": "array", "items": {"anyOf": [{"type": "integer", "multipleOf": 2}]}}}
    }
    assert refusal(schemas, nested).startswith("uses 'multipleOf' (at #/properties/xs/items/anyOf/0)")
    assert refusal(schemas, {"$defs": {"d": {"patternProperties": {}}}}).startswith(
        "uses 'patternProperties' (at #/$defs/d)"
    )


def test_property_names_are_not_keywords(schemas):
    assert schemas.error(json.dumps({"type": "object", "properties": {"not": {"type": "string"}}})) is None


INTEGER = {"a": {"type": "integer"}}


@pytest.mark.parametrize(
    "schema, invalid, named",
    [
        # allOf of several: xgrammar follows one ("Support for allOf with multiple options is still ongoing")
        ({"allOf": [{"type": "integer"}, {"minimum": 10}]}, "3", "'allOf' with 2 subschemas (at #)"),
        ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, '"abcdef"', "'allOf' with 2 subschemas (at #)"),
        # one allOf (or $ref, const, enum, anyOf, oneOf) beside another constraint: it alone is followed
        ({"type": "integer", "allOf": [{"minimum": 10}]}, '"s"', "'allOf' beside 'type' (at #)"),
        (
            {"type": "object", "properties": INTEGER, "allOf": [{"required": ["a"]}]},
            "{}",
            "'allOf' beside 'type' (at #)",
        ),
        (
            {"type": "object", "properties": {"o": {"properties": INTEGER, "anyOf": [{"required": ["a"]}]}}},
            '{"o": {}}',
            "'anyOf' beside 'properties' (at #/properties/o)",
        ),
        (
            {"$ref": "#/$defs/i", "minimum": 10, "$defs": {"i": {"type": "integer"}}},
            "3",
            "'$ref' beside 'minimum'",
        ),
        ({"type": "string", "enum": ["a", "bb"], "minLength": 2}, '"a"', "'enum' beside 'minLength' (at #)"),
        ({"const": "abc", "pattern": "^x"}, '"abc"', "'const' beside 'pattern' (at #)"),
        (
            {"type": "array", "items": {"enum": [1, 2], "maximum": 1}},
            "[2]",
            "'enum' beside 'maximum' (at #/items)",
        ),
        # enum's or const's type: dropped too, so every value must have it
        ({"type": "string", "enum": ["a", 1]}, "1", "'enum' value 1 not of its type \"string\" (at #)"),
        ({"type": "integer", "const": True}, "true", "'const' value true not of its type \"integer\""),
        # required names a property properties does not declare: xgrammar's object takes it out ({} passes)
        (
            {"type": "object", "properties": INTEGER, "required": ["a", "b"]},
            '{"a": 1}',
            "'required' naming \"b\", absent from 'properties' (at #)",
        ),
        (
            {"type": "object", "additionalProperties": {"type": "integer"}, "required": ["b"]},
            "{}",
            "'required' naming \"b\", absent from 'properties' (at #)",
        ),
        (
            {"$ref": "#/$defs/d", "$defs": {"d": {"type": "object", "required": ["q"]}}},
            "{}",
            "'required' naming \"q\", absent from 'properties' (at #/$defs/d)",
        ),
    ],
)
def test_what_xgrammar_would_follow_in_part_is_refused_naming_it(
    schemas, xgrammar_compiler, schema, invalid, named
):
    """Each schema's grammar takes a value the schema forbids, so the planner refuses the schema, naming what
    xgrammar would drop and where."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(invalid), schema)
    assert grammar_takes(xgrammar_compiler, schema, invalid)  # why it is refused: it would not be enforced
    assert f"uses {named}" in refusal(schemas, schema)
    assert refusal(schemas, schema).split(")", 1)[1].startswith(", which structured output does not enforce")


@pytest.mark.parametrize(
    "schema, valid, invalid",
    [
        ({"allOf": [{"type": "integer", "minimum": 10}], "description": "one"}, "12", "3"),
        ({"type": "string", "enum": ["a", "bb"], "title": "t", "default": "a"}, '"bb"', '"c"'),
        ({"type": ["string", "null"], "enum": ["a", None]}, "null", '"b"'),
        ({"type": "integer", "enum": [1.0, 2]}, "1", "3"),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}, "null", '"s"'),
        (
            {
                "oneOf": [{"$ref": "#/$defs/i"}],
                "discriminator": {"propertyName": "k"},
                "$defs": {"i": {"type": "integer"}},
            },
            "1",
            "[]",
        ),
        ({"type": "object", "properties": INTEGER, "required": ["a"]}, '{"a": 1}', "{}"),
    ],
)
def test_what_xgrammar_enforces_whole_is_not_refused(schemas, xgrammar_compiler, schema, valid, invalid):
    """Annotations and other vocabularies' keywords beside a selector, enum's and const's own type, and a
    required property declared: the grammar takes the valid value and not the invalid one. (A guard against
    refusing too much: it passes without the refusals too.)"""
    assert schemas.error(json.dumps(schema)) is None
    jsonschema.validate(json.loads(valid), schema)
    assert grammar_takes(xgrammar_compiler, schema, valid)
    assert not grammar_takes(xgrammar_compiler, schema, invalid)


def test_one_of_is_taken_as_any_of(schemas, xgrammar_compiler):
    """oneOf's exclusivity is not enforced (nor by vLLM): a value two branches match passes; README says so."""
    schema = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    assert schemas.error(json.dumps(schema)) is None
    assert grammar_takes(xgrammar_compiler, schema, "3")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(3, schema)
