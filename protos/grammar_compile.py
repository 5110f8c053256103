"""How both services make a JSON grammar with xgrammar: the planner compiles a schema at intake to check it, the
executor compiles it again to mask a row's tokens. One function, so the grammar the planner accepted is the one
the executor enforces."""

from __future__ import annotations

from typing import Any

# Whitespace characters a grammar allows in one run between JSON tokens. xgrammar allows any number by default,
# so a model could pad a value with spaces and newlines until max_tokens ({"type": "json_object"} on "hello"
# gave '{\n    "Hello, World!"\n\n:\n\n' and blank lines to the end). 20 still lets pretty-printed JSON nest
# 9 levels at 2 spaces a level (a newline and 18 spaces), 4 at 4.
MAX_JSON_WHITESPACE = 20
# json_object: any object (xgrammar's builtin JSON grammar allows any value and takes no whitespace cap)
ANY_OBJECT = '{"type": "object"}'


def compile_json(compiler: Any, grammar: str) -> Any:
    """`grammar` compiled by `compiler` (an xgrammar GrammarCompiler): "" any JSON object (json_object, keys not
    limited), else a JSON schema's text, strict (no properties beyond those it declares); whitespace runs of at
    most MAX_JSON_WHITESPACE. xgrammar's RuntimeError or ValueError where it refuses the schema."""
    return compiler.compile_json_schema(
        grammar or ANY_OBJECT, strict_mode=bool(grammar), max_whitespace_cnt=MAX_JSON_WHITESPACE
    )
