"""The bounds on what a structured-output schema asks of the grammar compiler (schema_limits.py), alone."""

from __future__ import annotations

import json

import pytest

from planner_svc.schema_limits import MAX_PATTERN_REPEATS, json_depth, pattern_repeats, schema_limit_error


def test_json_depth_counts_nested_objects_and_arrays():
    assert [json_depth(v) for v in (1, "x", {}, [], {"a": [1, {"b": 2}]}, [[[]]])] == [0, 0, 1, 1, 3, 3]


@pytest.mark.parametrize(
    "pattern, repeats",
    [
        ("abc", 0),
        ("c{3}", 3),
        ("c{2,5}", 5),
        ("c{4,}", 4),
        (r"\d{3}-\d{4}", 7),
        (r"a\{9}", 0),  # an escaped brace is a literal
        (r"a\\{9}", 9),  # an escaped backslash, then a quantifier
        ("(ab{2}){10}", 12),  # nesting is not multiplied out: the compiler repeats the group's states
        ("c{" + "9" * 5000 + "}", 10**9),  # too long for int(), far over the bound anyway
    ],
)
def test_pattern_repeats_sums_the_counted_quantifiers(pattern, repeats):
    assert pattern_repeats(pattern) == repeats


def test_a_schema_is_refused_for_depth_infinity_or_repeats_and_nothing_else():
    assert (
        schema_limit_error({"type": "object", "properties": {"a": {"type": "string", "pattern": "x{9}"}}})
        is None
    )
    deep: dict = {}
    for _ in range(65):
        deep = {"items": deep}
    assert schema_limit_error(deep) == "nests deeper than 64 objects and arrays"
    assert "not finite (inf" in (schema_limit_error(json.loads('{"maximum": 1e400}')) or "")
    assert "not finite (nan" in (schema_limit_error(json.loads('{"enum": [NaN]}')) or "")
    # the repeats of every pattern add up, wherever they sit
    half = f"c{{{MAX_PATTERN_REPEATS // 2}}}"
    two = {"properties": {"a": {"pattern": half}, "b": {"items": {"pattern": half}}}}
    assert schema_limit_error(two) is None
    two["properties"]["c"] = {"pattern": "c{1}"}
    assert f"add up to {MAX_PATTERN_REPEATS + 1}; at most {MAX_PATTERN_REPEATS}" in (
        schema_limit_error(two) or ""
    )
    # a property named "pattern" is a schema, not a regex
    assert schema_limit_error({"properties": {"pattern": {"type": "string"}}}) is None
