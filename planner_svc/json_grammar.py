"""Structured output's schemas, checked before a request runs: what the grammar engine would follow only in
part is refused, named with where it is (a keyword it does not enforce, an allOf of several schemas, a keyword
after which it reads nothing else of its schema beside another constraint, a required property it does not
declare), and the schema must compile (xgrammar, with the model's tokenizer)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

from protos.grammar_compile import compile_json
from protos.grammar_errors import compile_error
from protos.model_files import TRANSFORMERS_IMPORTS

# Keywords xgrammar's JSON Schema converter does not enforce: a schema using one would be followed only in
# part, so it is refused rather than half-honoured.
UNENFORCED_KEYWORDS = frozenset(
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
# Keywords after which xgrammar's converter reads nothing else of their schema: it follows the first of them it
# finds, in this order, alone ({"type": "integer", "allOf": [{"minimum": 10}]} took any value, {"enum": ["a",
# "bb"], "minLength": 2} took "a"), so one of them beside another constraint would be followed only in part.
SELECTORS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# What constrains a value as xgrammar reads it. Annotations (title, description, default, examples, ...), $defs
# and other vocabularies' keywords (OpenAPI's discriminator) constrain nothing: they may stand beside a selector.
CONSTRAINTS = frozenset(
    {
        *SELECTORS,
        "type",
        "properties",
        "required",
        "additionalProperties",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
    }
)
# xgrammar's compile cache (repeated schemas compile once) is unbounded unless given a limit
SCHEMA_CACHE_BYTES = 64 << 20

_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # {name: schema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
_SCHEMAS = ("items", "additionalProperties")  # schema (or a boolean)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "null": (type(None),),
    "array": (list,),
    "object": (dict,),
}
_SHOWN_CHARS = 40  # of a value named in a refusal


def unenforced(schema: Any) -> str | None:
    """What of `schema` (parsed) or its subschemas xgrammar would follow only in part, in words with where it
    is ("uses 'not' (at #/properties/a), which structured output does not enforce"), or None."""
    for where, node in _subschemas(schema, "#"):
        found = _unenforced_here(node)
        if found is not None:
            what, why = found
            return f"uses {what} (at {where}), which structured output does not enforce{why}"
    return None


def _subschemas(schema: Any, where: str) -> Iterator[tuple[str, dict]]:
    """`schema` and every schema in it (properties, $defs, anyOf/oneOf/allOf, items...), each with where it is
    ('#/properties/a'), parents first."""
    if not isinstance(schema, dict):
        return
    yield where, schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from _subschemas(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _subschemas(sub, f"{where}/{key}/{i}")
    for key in _SCHEMAS:
        if key in schema:
            yield from _subschemas(schema[key], f"{where}/{key}")


def _unenforced_here(node: dict) -> tuple[str, str] | None:
    """(what, why) of one schema, not its subschemas, that xgrammar would follow only in part, or None."""
    for key in node:
        if key in UNENFORCED_KEYWORDS:
            return repr(key), ""
    every = node.get("allOf")
    if isinstance(every, list) and len(every) > 1:
        return (
            f"'allOf' with {len(every)} subschemas",
            ": xgrammar follows one alone; merge them into one schema",
        )
    selector = next((key for key in SELECTORS if key in node), None)
    if selector is not None:
        values = selector in ("enum", "const")  # they may keep a type every value has
        beside = [
            key for key in node if key in CONSTRAINTS and key != selector and not (values and key == "type")
        ]
        if beside:
            return (
                f"{selector!r} beside {beside[0]!r}",
                f": xgrammar follows {selector!r} alone, dropping the rest",
            )
        if values and "type" in node:
            wrong = _not_of_type(node["enum"] if selector == "enum" else [node["const"]], node["type"])
            if wrong:
                return (
                    f"{selector!r} value {_shown(wrong[0])} not of its type {_shown(node['type'])}",
                    f": xgrammar follows {selector!r} alone; drop the value or widen the type",
                )
    required, declared = node.get("required"), node.get("properties")
    if isinstance(required, list):
        names = declared if isinstance(declared, dict) else {}
        missing = [name for name in required if not isinstance(name, str) or name not in names]
        if missing:
            return (
                f"'required' naming {_shown(missing[0])}, absent from 'properties'",
                ": xgrammar requires only the properties declared there; declare it",
            )
    return None


def _not_of_type(values: Any, types: Any) -> list:
    """The first of `values` (enum's or const's) of none of JSON Schema's `types` (a name or a list) in a list,
    or an empty one."""
    names = types if isinstance(types, list) else [types]
    for value in values if isinstance(values, list) else []:
        if not any(_of_type(value, name) for name in names):
            return [value]
    return []


def _of_type(value: Any, name: Any) -> bool:
    if isinstance(value, bool) and name != "boolean":  # bool is an int to Python, not a number to JSON
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(name, str) and isinstance(value, _JSON_TYPES.get(name, ()))


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


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
        found = unenforced(json.loads(schema_text))
        if found is not None:
            return found
        with self._lock:
            with TRANSFORMERS_IMPORTS:  # xgrammar imports transformers: not beside another thread's import
                import xgrammar
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=SCHEMA_CACHE_BYTES)
            try:
                compile_json(self._compiler, schema_text)  # as the executor will
            except (RuntimeError, ValueError) as error:
                return f"cannot be compiled: {compile_error(error)}"
        return None
