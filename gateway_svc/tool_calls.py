"""A chat answer's calls of the request's tools, found in its text: pure, no I/O.

Models trained on tools write each call in <tool_call> tags, as JSON (Hermes', Qwen2.5's and Qwen3's form:
{"name": ..., "arguments": {...}}) or as XML (Qwen3-Coder's and Qwen3.5's: <function=NAME><parameter=KEY>
value</parameter></function>), or as Llama 3 does, without tags: an answer that is JSON calls alone, several
separated by `;` ({"name": ..., "parameters": {...}}). Text before the first call is the message's content
(calls are looked for after a </think>, where a reasoning model's thought ends); text after tagged calls is
dropped. A call that does not parse, is not closed (cut by max_tokens), or names no tool of the request,
leaves the whole text as content, as if no call were made.

Where the request forces a call (tool_choice required, or a named function), the answer is held to a JSON
Schema instead (structured output): the named function's arguments, or a list of calls of any tool.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from protos.thought import THOUGHT_END

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_JSON = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The tools a choice may call (each function's name and its parameters' JSON Schema), and whether it must:
    `auto` (it may, in <tool_call> tags), `required` (one call or more), `named` (a call of `name`)."""

    parameters: Mapping[str, Mapping[str, Any]]
    mode: Literal["auto", "required", "named"] = "auto"
    name: str | None = None  # the function a `named` choice calls

    @classmethod
    def of(cls, tools: Sequence[Any]) -> ToolSpec:
        """From OpenAI's tools list (entries not of that shape are skipped: the planner refuses them)."""
        parameters: dict[str, Mapping[str, Any]] = {}
        for tool in tools:
            function = (
                tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            )
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                schema = function.get("parameters")
                parameters[function["name"]] = schema if isinstance(schema, dict) else {}
        return cls(parameters)

    def _arguments_schema(self, name: str) -> Mapping[str, Any]:
        return self.parameters[name] or {"type": "object"}

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of a forced call's answer: the named function's arguments, or (required) a list of
        one call or more, each {"name": ..., "parameters": {...}} of a tool (vLLM's form)."""
        if self.mode == "named":
            assert self.name is not None
            return dict(self._arguments_schema(self.name))
        calls, definitions = [], {}
        for number, name in enumerate(self.parameters):
            arguments, defined = _hoisted(self._arguments_schema(name), f"tool{number}_")
            definitions.update(defined)
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": arguments},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return {**schema, "$defs": definitions} if definitions else schema

    def find(self, text: str) -> tuple[str, list[dict[str, Any]]] | None:
        """(the content, the calls) `text` makes, or None where it makes none."""
        if self.mode == "auto":
            return parse_calls(text, self)
        if self.mode == "named":
            assert self.name is not None
            return "", [_call(self.name, text.strip())]  # arguments as written, even cut by max_tokens
        try:
            calls = json.loads(text)
        except (ValueError, RecursionError):  # cut by max_tokens
            return None
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and {"name", "parameters"} <= set(c) for c in calls
        ):
            return None  # the grammar holds the answer to the schema: not expected
        written = _calls([(c["name"], c["parameters"]) for c in calls])
        return None if written is None else ("", written)


_DEFINITIONS = ("$defs", "definitions")


def _hoisted(schema: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tool's parameters schema without its definitions, and those definitions renamed with `prefix`: nested
    in the required list's schema, its `#/$defs/X` references would no longer resolve (Pydantic's schemas of
    nested models have them), so they move to the root and its references are rewritten."""
    definitions = {
        f"{prefix}{key}": value
        for where in _DEFINITIONS
        if isinstance(schema.get(where), dict)
        for key, value in schema[where].items()
    }
    if not definitions:
        return dict(schema), {}

    def moved(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            for where in _DEFINITIONS:
                if isinstance(ref, str) and ref.startswith(f"#/{where}/"):
                    node = {**node, "$ref": f"#/$defs/{prefix}{ref[len(where) + 3 :]}"}
            return {key: moved(value) for key, value in node.items()}
        return [moved(item) for item in node] if isinstance(node, list) else node

    rest = {key: value for key, value in schema.items() if key not in _DEFINITIONS}
    return moved(rest), {key: moved(value) for key, value in definitions.items()}


def _call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of OpenAI's tool_calls: the arguments as JSON text."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _calls(found: Sequence[tuple[str, Any]]) -> list[dict[str, Any]] | None:
    """OpenAI's tool_calls of (name, arguments) pairs; None where arguments nest too deep to write back as JSON
    (read just under the recursion limit)."""
    try:
        return [_call(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in found]
    except RecursionError:
        return None


def _named_call(call: Any) -> tuple[str, Any] | None:
    """A JSON call's (name, arguments): {"name": ..., "arguments" or "parameters": {...}}."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def _json_calls(body: str) -> list[tuple[str, Any]] | None:
    try:
        found = _named_call(json.loads(body))
    except (ValueError, RecursionError):
        return None
    return None if found is None else [found]


def _bare_calls(text: str) -> list[tuple[str, Any]] | None:
    """Llama 3's form, no tags: the answer is JSON calls alone, each with its `parameters` (or `arguments`),
    several separated by `;`; None where it is not."""
    calls, at = [], 0
    while at < len(text):
        try:
            value, at = _JSON.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        named = isinstance(value, dict) and ("parameters" in value or "arguments" in value)
        found = _named_call(value) if named else None
        if found is None:
            return None
        calls.append(found)
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return calls


def _value(text: str, schema: Any) -> Any:
    """An XML parameter's value: the text for a string (or a parameter the schema does not type), null for a
    nullable one's `null`, else the JSON value it spells (a number, a boolean, an object), else the text."""
    text = text.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = {k for k in (kind if isinstance(kind, list) else [kind]) if k is None or isinstance(k, str)}
    if "null" in kinds and text == "null":
        return None
    if not kinds or kinds & {None, "string"}:  # untyped (or typed in no way JSON Schema names): the text
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _xml_calls(body: str, spec: ToolSpec) -> list[tuple[str, Any]] | None:
    """The functions a block calls in XML (one or more), each closed; None where it holds none."""
    calls = []
    for function in _FUNCTION.finditer(body):
        name = function.group(1).strip()
        properties = spec.parameters.get(name, {}).get("properties", {})
        properties = properties if isinstance(properties, dict) else {}
        arguments = {
            key.strip(): _value(value, properties.get(key.strip()))
            for key, value in _PARAMETER.findall(function.group(2))
        }
        calls.append((name, arguments))
    return calls or None


def _blocks(text: str, at: int) -> list[str] | None:
    """The bodies of the call blocks from `at` on; None where one is not closed. A JSON body is read whole, so
    that a CALL_CLOSE inside one of its strings (code) does not end it."""
    bodies = []
    while (at := text.find(CALL_OPEN, at)) >= 0:
        body = at + len(CALL_OPEN)
        close_from = body
        first = len(text) - len(text[body:].lstrip())
        if text.startswith("{", first):
            try:
                close_from = _JSON.raw_decode(text, first)[1]
            except (ValueError, RecursionError):
                pass  # not JSON: the block is read as XML, or refused
        end = text.find(CALL_CLOSE, close_from)
        if end < 0:
            return None
        bodies.append(text[body:end])
        at = end + len(CALL_CLOSE)
    return bodies


def _tagged_calls(text: str, start: int, spec: ToolSpec) -> list[tuple[str, Any]] | None:
    """The calls of the <tool_call> blocks from `start` on, each JSON or XML; None where one is not a call."""
    bodies = _blocks(text, start)
    if not bodies:
        return None
    calls = []
    for body in bodies:
        found = _json_calls(body.strip()) or _xml_calls(body, spec)
        if found is None:
            return None
        calls += found
    return calls


def parse_calls(text: str, spec: ToolSpec) -> tuple[str, list[dict[str, Any]]] | None:
    """(the content before the first call, the calls) where `text` makes calls, each whole, closed and of a tool
    of `spec`; None where it makes none."""
    thought = text.rfind(THOUGHT_END)
    answer = 0 if thought < 0 else thought + len(THOUGHT_END)
    start = text.find(CALL_OPEN, answer)
    if start >= 0:
        found = _tagged_calls(text, start, spec)
    else:  # no tag: the answer may be Llama 3's bare JSON
        start = len(text) - len(text[answer:].lstrip())
        found = _bare_calls(text[start:].rstrip()) if text.startswith("{", start) else None
    if found is None or any(name not in spec.parameters for name, _ in found):
        return None
    calls = _calls(found)
    return None if calls is None else (text[:start], calls)


def tag_begun(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back until the next text says)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice's text, passed on as content until a call may begin (a forced call's: none of it);
    the calls at the end."""

    spec: ToolSpec
    _held: list[str] = field(default_factory=list)  # pieces: a long call is joined once, at the end
    _calling: bool = False  # CALL_OPEN was seen (or the call is forced): everything from it is held
    _spoken: bool = False  # content other than white space went out (before it, white space is held: the
    # whole answer's content is null where only white space comes before a call)
    _answer_spoken: bool = False  # and since the last THOUGHT_END (before it, the answer may be bare JSON)

    def __post_init__(self) -> None:
        self._calling = self.spec.mode != "auto"

    def feed(self, text: str) -> str:
        """The content of `text` to send now."""
        if self._calling:
            self._held.append(text)
            return ""
        held = "".join([*self._held, text])
        thought = held.rfind(THOUGHT_END)
        answer = 0 if thought < 0 else thought + len(THOUGHT_END)  # where the answer after a thought begins
        self._answer_spoken = self._answer_spoken and thought < 0
        at = held.find(CALL_OPEN)
        rest = held[answer:].lstrip()
        if at < 0 and not self._answer_spoken and rest.startswith("{"):  # Llama 3's bare JSON may begin
            at = len(held) - len(rest)
        keep = len(held) - at if at >= 0 else max(tag_begun(held, CALL_OPEN), tag_begun(held, THOUGHT_END))
        if not self._spoken and not held[: len(held) - keep].strip():
            keep = len(held)
        self._calling = at >= 0
        self._held = [held[len(held) - keep :]] if keep else []
        sent = held[: len(held) - keep]
        self._spoken = self._spoken or bool(sent)
        self._answer_spoken = self._answer_spoken or bool(sent[answer:].strip())
        return sent

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the choice's end: the content still to send, and the calls made (none: the held text is content)."""
        held, self._held = "".join(self._held), []
        parsed = self.spec.find(held) if self._calling else None
        if parsed is None:
            return held, []
        content, calls = parsed
        return (content if self._spoken or content.strip() else ""), calls
