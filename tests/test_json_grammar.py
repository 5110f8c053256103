"""Structured output's schema check (planner_svc/json_grammar.py), alone."""

from __future__ import annotations

from planner_svc.json_grammar import unsupported_keyword


def test_unsupported_keywords_are_found_with_where_they_are():
    assert unsupported_keyword({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    assert unsupported_keyword({"not": {}}) == "#: not"
    nested = {
        "properties": {"xs": {"type": "array", "items": {"anyOf": [{"type": "integer", "multipleOf": 2}]}}}
    }
    assert unsupported_keyword(nested) == "#/properties/xs/items/anyOf/0: multipleOf"
    assert unsupported_keyword({"$defs": {"d": {"patternProperties": {}}}}) == "#/$defs/d: patternProperties"


def test_property_names_are_not_keywords():
    assert unsupported_keyword({"type": "object", "properties": {"not": {"type": "string"}}}) is None
