"""What a JSON schema for structured output may ask of the grammar compiler, checked on the parsed schema before
it is compiled (pure: no xgrammar). The compiler runs under one lock at intake, so a schema that takes it long
holds up every request behind it: these bounds keep one compile to a fraction of a second."""

from __future__ import annotations

import math
import re

# Objects and arrays nested: an array of arrays 200 deep took 0.5 s to compile, 800 deep 20 s.
MAX_SCHEMA_DEPTH = 64
# Counted repeats ({n}, {n,m}, {n,}) of all the schema's "pattern" regexes, summed: the compiler expands each into
# that many states (c{2000} took 0.15 s, c{5000} 1 s, c{20000} 17 s; sixty c{1000} 2.3 s).
MAX_PATTERN_REPEATS = 4096

_QUANTIFIER = re.compile(r"\\.|\{(\d+)(?:,(\d*))?\}")  # an escape (skipped), or a counted quantifier
# a count this long is already far over the bound (and int() of thousands of digits refuses)
_COUNT_DIGITS = 9


def json_depth(value: object) -> int:
    """How deep objects and arrays nest in a parsed JSON value (a scalar: 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def pattern_repeats(pattern: str) -> int:
    """The counts of a regex's counted quantifiers, summed: {3} is 3, {2,5} is 5, {4,} is 4 (what the compiler
    spells out); an escaped brace counts nothing."""
    total = 0
    for match in _QUANTIFIER.finditer(pattern):
        low, high = match.group(1), match.group(2)
        if low is not None:
            count = high or low
            total += int(count) if len(count) <= _COUNT_DIGITS else 10**_COUNT_DIGITS
    return total


def schema_limit_error(schema: object) -> str | None:
    """Why the compiler should not be given `schema` (a parsed JSON value), or None: nested too deep, a number
    JSON reads as infinity or NaN (1e400), or patterns that repeat too much."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        return f"nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays"
    repeats, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return f"has a number that is not finite ({node}: JSON numbers such as 1e400 read as infinity)"
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                repeats += pattern_repeats(pattern)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if repeats > MAX_PATTERN_REPEATS:
        return (
            f"has patterns whose counted repeats ({{n}}, {{n,m}}) add up to {repeats}; at most "
            f"{MAX_PATTERN_REPEATS} (the grammar compiler spells each one out)"
        )
    return None
