"""Tool use in conversational data: an assistant message's tool calls and a conversation's
declared tools, checked and put in the form transformers' chat templates take
(``apply_chat_template(messages, tools=...)``)."""

from __future__ import annotations

import json
from typing import Any

from trainer_core.errors import DataError

SCHEMAS = "a list of function schemas"
"""What a conversation's ``tools`` must be (:func:`declared_tools`)."""


def parse_json(text: str, where: str, kind: type = object, expected: str = "JSON") -> Any:
    """The JSON value of ``text`` (a record's line, a column holding JSON), which must be a ``kind``.

    Raises:
        DataError: ``text`` is not JSON (the parser's message and column), or its value is not a
            ``kind`` (``expected`` says what it must be); the message starts with ``where``.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(value, kind):
        raise DataError(f"{where}: expected {expected}, got {type(value).__name__}")
    return value


def tool_call(call: Any, where: str) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "arguments": dict}}`` of one tool call
    (JSON-string arguments parsed).

    Raises:
        DataError: no function name, or arguments that are not an object (or a JSON string of
            one); the message starts with ``where`` (the record's source and field).
    """
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", {}) if isinstance(function, dict) else None
    if isinstance(arguments, str):
        arguments = parse_json(arguments, f"{where} arguments")
    if not (isinstance(name, str) and name and isinstance(arguments, dict)):
        raise DataError(f"{where} must be {{'function': {{'name': str, 'arguments': object}}}}, got {call!r}")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def declared_tools(value: Any, where: str) -> list[dict] | None:
    """A conversation's declared tools (a record's ``tools`` column) as
    ``apply_chat_template(tools=...)`` takes them: a list (or a JSON string of one) of function
    schemas ``{"type": "function", "function": {"name", "description", "parameters"}}`` (a bare
    ``{"name", ...}`` is wrapped so); None when absent or empty.

    Raises:
        DataError: not a list of schemas, or a schema without a function name (names the item);
            the message starts with ``where``.
    """
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        value = parse_json(value, where, list, SCHEMAS)
    elif not isinstance(value, list):
        raise DataError(f"{where}: expected {SCHEMAS}, got {type(value).__name__}")
    tools = []
    for i, tool in enumerate(value):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]):
            raise DataError(
                f"{where}[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}, got {tool!r}"
            )
        tools.append({"type": "function", "function": function})
    return tools or None
