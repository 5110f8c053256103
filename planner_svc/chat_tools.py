"""A chat's tools and its assistants' tool calls, parsed from the JSON text the wire carries into what chat
templates read: pure, no tokenizer."""

from __future__ import annotations

import json
from typing import Any

from planner_svc.schema_limits import json_depth
from planner_svc.validation import InvalidRequest, json_field

MAX_TOOLS = 128
MAX_TOOL_CALLS = 64  # of one message
# Objects and arrays nested: a tool's parameters are a JSON Schema (an object's property's items' ...), and
# transformers copies every value recursively (~450 levels overflow).
MAX_TOOLS_DEPTH = 64


def _function(field: str, item: Any) -> dict[str, Any]:
    """`item`'s function object, checked to have a name."""
    function = item.get("function") if isinstance(item, dict) and item.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest(f'{field} must be {{"type": "function", "function": {{"name": ..., ...}}}}')
    return function


def parse_tools(text: str) -> list[dict[str, Any]] | None:
    """The tools of a chat ("" is none): a list of OpenAI's function tools, as the chat template reads them."""
    if not text:
        return None
    tools = json_field("chat.tools", text, MAX_TOOLS_DEPTH)
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("chat.tools must be a non-empty JSON list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"chat.tools has at most {MAX_TOOLS} tools, got {len(tools)}")
    for index, tool in enumerate(tools):
        _function(f"chat.tools[{index}]", tool)
    return tools


def parse_tool_calls(index: int, text: str) -> list[dict[str, Any]]:
    """Message `index`'s tool calls ("" is none), each function's arguments a mapping where their JSON text is
    an object: templates render arguments with `| tojson` or walk their items, as transformers documents."""
    if not text:
        return []
    field = f"chat.messages[{index}].tool_calls"
    calls = json_field(field, text, MAX_TOOLS_DEPTH)
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise InvalidRequest(f"{field} must be a JSON list of at most {MAX_TOOL_CALLS} tool calls")
    parsed = []
    for number, call in enumerate(calls):
        function = dict(_function(f"{field}[{number}]", call))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except (ValueError, RecursionError):
                decoded = None  # not JSON: the template gets the text as it came
            if isinstance(decoded, dict) and json_depth(decoded) <= MAX_TOOLS_DEPTH:
                function["arguments"] = decoded
        parsed.append({**call, "function": function})
    return parsed
