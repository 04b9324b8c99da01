"""Tool calls on chat completions: the model's `<tool_call>{json}</tool_call>` output (Hermes / Qwen format,
which checkpoints/tokenizer.py teaches templates that have no tool support) parsed into OpenAI `tool_calls`.

    model text:  'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    response:    content 'Let me look.', tool_calls [{id, type: function, function: {name, arguments: '{"city"...'}}]

A block that is not a JSON object with a string `name` is left in the content (the model did not make a valid
call). `tool_choice` "required" or a named function is enforced by a grammar of these blocks
(serving/api/guided.py), so the call is always valid.
"""

from __future__ import annotations

import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse_tool_calls(text: str, call_prefix: str) -> tuple[str, list[dict]]:
    """(content without the valid tool-call blocks, OpenAI tool_calls) of a finished chat output; call ids are
    `call_<call_prefix>_<i>`."""
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        name, args = call
        calls.append(
            {
                "id": f"call_{call_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


def _call(body: str) -> tuple[str, dict] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class StreamHoldback:
    """Streams content deltas but holds back text from a possible `<tool_call>` on: once the tag is complete
    nothing more is streamed as content (the calls go out in the last chunk); text that turns out not to start
    the tag is released."""

    def __init__(self):
        self._pending = ""
        self._in_call = False

    def feed(self, text: str, finished: bool) -> str:
        if self._in_call:
            return ""
        self._pending += text
        start = self._pending.find(OPEN)
        if start >= 0:
            self._in_call = True
            out, self._pending = self._pending[:start], ""
            return out
        if finished:
            out, self._pending = self._pending, ""
            return out
        keep = _partial_tag_suffix(self._pending)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out) :]
        return out


def _partial_tag_suffix(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
