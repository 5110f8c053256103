"""Structured output's schemas, checked before a request runs: JSON Schema keywords the grammar engine would
not enforce are refused by name, and the schema must compile (xgrammar, with the model's tokenizer)."""

from __future__ import annotations

import json
import threading
from typing import Any

from protos.grammar_errors import compile_error
from protos.model_files import TRANSFORMERS_IMPORTS

# Keywords xgrammar's JSON Schema converter does not enforce: a schema using one would be followed only in
# part, so it is refused rather than half-honoured.
UNSUPPORTED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "multipleOf",
        "uniqueItems",
    }
)
# xgrammar's compile cache (repeated schemas compile once) is unbounded unless given a limit
SCHEMA_CACHE_BYTES = 64 << 20

_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # {name: schema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
_SCHEMAS = ("items", "additionalProperties")  # schema (or a boolean)


def unsupported_keyword(schema: Any, where: str = "#") -> str | None:
    """The first keyword of UNSUPPORTED in `schema` or its subschemas, with where it is ('#/properties/a:
    not'), or None."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED:
            return f"{where}: {key}"
    children: list[tuple[str, Any]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(f"{where}/{key}/{name}", sub) for name, sub in schema[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(f"{where}/{key}/{i}", sub) for i, sub in enumerate(schema[key])]
    children += [(f"{where}/{key}", schema[key]) for key in _SCHEMAS if key in schema]
    for path, sub in children:
        found = unsupported_keyword(sub, path)
        if found is not None:
            return found
    return None


class SchemaCompiler:
    """Compiles schemas with the model's tokenizer to prove they can constrain it (built with the first)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()  # intake's tokenizing threads

    def error(self, schema_text: str) -> str | None:
        """Why `schema_text` cannot constrain the output (an unsupported keyword, or xgrammar's own refusal),
        or None."""
        found = unsupported_keyword(json.loads(schema_text))
        if found is not None:
            return f"uses {found.split(': ')[1]!r} (at {found.split(': ')[0]}), which structured output does not enforce"
        with self._lock:
            with TRANSFORMERS_IMPORTS:  # xgrammar imports transformers: not beside another thread's import
                import xgrammar
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=SCHEMA_CACHE_BYTES)
            try:
                self._compiler.compile_json_schema(schema_text, strict_mode=True)
            except (RuntimeError, ValueError) as error:
                return f"cannot be compiled: {compile_error(error)}"
        return None
