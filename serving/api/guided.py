"""Structured-output fields of a request body turned into one engine `Constraint` (serving/core/request.py).

    response_format {"type": "json_object"}                      -> Constraint("json_object")
    response_format {"type": "json_schema", "json_schema": {...}} -> Constraint.json_schema(schema)
    guided_json / guided_regex / guided_grammar / guided_choice   -> json_schema / regex / grammar / choice (vLLM)
    tool_choice "required" or {"type": "function", ...}          -> a Lark grammar of `<tool_call>` blocks whose
                                                                     JSON is one of the allowed tools' calls

At most one of them may be given. The engine compiles the constraint with llguidance (serving/engine/structured.py);
a constraint that does not compile is refused there with a 400 naming the reason.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from serving.api.protocol import OpenAIError
from serving.api.tools import CLOSE, OPEN
from serving.core.request import Constraint

_GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def body_constraint(body) -> tuple[Constraint | None, str | None]:
    """(the constraint of a completions or chat body, or None; the field it came from)."""
    found: list[tuple[str, Constraint]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint("json_object")))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        found.append(("response_format", Constraint.json_schema(schema)))
    if body.guided_json is not None:
        found.append(("guided_json", Constraint.json_schema(body.guided_json)))
    if body.guided_regex is not None:
        found.append(("guided_regex", Constraint("regex", body.guided_regex)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", Constraint("grammar", body.guided_grammar)))
    if body.guided_choice is not None:
        found.append(("guided_choice", Constraint.choice(body.guided_choice)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise OpenAIError(400, f"give at most one structured-output field; got {names}", param=found[1][0])
    if not found:
        return None, None
    name, c = found[0]
    try:
        return c.validate(), name
    except ValueError as e:
        raise OpenAIError(400, f"{name}: {e}", param=name) from e


def tool_constraint(tools: list[dict[str, Any]], tool_choice, parallel: bool | None) -> Constraint:
    """The grammar that makes the output tool calls, for tool_choice 'required' (any of `tools`) or a named
    function: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (one unless parallel_tool_calls
    is true), the arguments valid against the function's parameters schema.

    Raises:
      OpenAIError: a named function that is not among the tools, or no tools.
    """
    functions = [t["function"] for t in tools or ()]
    if not isinstance(tool_choice, str):
        name = tool_choice.function.name
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise OpenAIError(
                400, f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice"
            )
    if not functions:
        raise OpenAIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": _JSON_OPTIONS}
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = (
        f"start: call{repeat}\n"
        f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
        f"body: %json {json.dumps(schema)}\n"
    )
    return Constraint("grammar", lark)


async def precompile(llm, params) -> None:
    """Compiles the request's constraint on a worker thread (the engine thread then finds it in its cache, so a
    large grammar never stalls other requests' steps); a constraint that does not compile is a 400 here."""
    structured = getattr(getattr(llm, "engine", None), "structured", None)
    if params.constraint is None or structured is None:
        return
    try:
        await asyncio.to_thread(structured.compile, params.constraint)
    except ValueError as e:
        raise OpenAIError(400, str(e)) from e
