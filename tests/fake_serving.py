"""A model-free LLM for HTTP server tests: a character tokenizer and an engine that emits deterministic tokens.

Token id t is the character chr(97 + t % 26) ('a'..'z'); a prompt is its characters. Request with seed s emits
tokens (s + k) % 26 for k = 0, 1, ... with logprob -t / 10 (so best_of ranking is predictable), one per step.
A prompt containing "CALLTOOL" makes the engine write a Hermes tool call; one starting with token REJECT is
refused with a message naming the internal request id (as the real scheduler does). `gate` (threading.Event)
blocks steps while cleared; `encode_delay_s` slows tokenising. Prompt logprobs run through a fake runner whose
logits make token (p + 1) % 26 the most likely after position p; `runner.chunk_s` slows each chunk and
`runner.rows` records the chunks (start, length).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from serving.core.request import RequestOutput, prompt_token_ids
from serving.core.scheduler_output import SchedulerStats

VOCAB = 64
REJECT = 63
TOOL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class FakeTokenizer:
    eos_token_ids = ()
    max_token_chars = 1  # one character per token

    def __init__(self):
        self.encode_delay_s = 0.0
        self.encode_calls = 0

    def encode(self, text: str) -> list[int]:
        self.encode_calls += 1
        if self.encode_delay_s:
            time.sleep(self.encode_delay_s)
        return [ord(c) % 26 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + int(t) % 26) for t in ids)

    def token_text(self, t: int) -> str:
        return chr(97 + int(t) % 26)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None) -> str:
        body = "".join(f"{m['role']}:{m['content']};" for m in messages)
        return body + ("tools;" if tools else "")


@dataclasses.dataclass
class _Kv:
    num_usable_blocks: int = 12
    block_size: int = 16
    held: dict = dataclasses.field(default_factory=dict)  # request id -> blocks held by prompt-logprob work

    def can_allocate(self, req, n: int) -> bool:
        return -(-(req.num_computed_tokens + n) // self.block_size) <= self.num_usable_blocks

    def allocate(self, req, n: int):
        blocks = -(-(req.num_computed_tokens + n) // self.block_size)
        req.block_ids = list(range(1, blocks + 1))
        self.held[req.request_id] = blocks
        return dataclasses.make_dataclass("Alloc", [("cow_pairs", tuple)])(())

    def release(self, req) -> None:
        self.held.pop(req.request_id, None)
        req.block_ids = []


class FakeRunner:
    """The part of ModelRunner prompt-logprob chunks use."""

    logit_buckets = (16,)

    def __init__(self):
        self.chunk_s = 0.0
        self.rows: list[tuple[int, int]] = []

    def copy_blocks(self, pairs) -> None:
        pass

    def router_load(self) -> None:  # a dense model
        return None

    def forward(self, rows) -> np.ndarray:
        if self.chunk_s:
            time.sleep(self.chunk_s)
        logits = np.zeros((self.logit_buckets[0], VOCAB), np.float32)
        off = 0
        for r in rows:
            self.rows.append((r.start, len(r.token_ids)))
            pos = np.arange(r.start, r.start + len(r.token_ids))
            logits[off + np.arange(len(pos)), (pos + 1) % 26] = 5.0
            off += len(pos)
        return logits


class FakeScheduler:
    def __init__(self):
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.kv = _Kv()
        self.max_num_seqs = 4

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def requests(self) -> dict:
        return {r["id"]: r for r in [*self.waiting, *self.running]}

    def stats(self) -> SchedulerStats:
        return SchedulerStats(self.num_waiting, len(self.running), 10, 1, 0, 0, 0, 0)


class FakeEngine:
    def __init__(self, tokenizer: FakeTokenizer):
        self.tokenizer = tokenizer
        self.scheduler = FakeScheduler()
        self.runner = FakeRunner()
        self.num_steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.added: list[tuple[list[int], object]] = []
        self.step_s = 0.002

    def add_request(self, ids, params, request_id, prompt=None):
        if ids and ids[0] == REJECT:
            raise ValueError(f"request {request_id!r} rejected: needs up to 99 KV blocks; the pool has 12")
        self.added.append((list(ids), params))
        tool = prompt is not None and "CALLTOOL" in prompt
        self.scheduler.waiting.append(
            {"id": request_id, "params": params, "k": 0, "tool": TOOL_TEXT if tool else None, "sent": 0}
        )

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def abort(self, request_id):
        s = self.scheduler
        s.waiting = collections.deque(r for r in s.waiting if r["id"] != request_id)
        s.running = [r for r in s.running if r["id"] != request_id]

    def pop_finished(self, request_id):
        return None

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        time.sleep(self.step_s)
        self.num_steps += 1
        s = self.scheduler
        while s.waiting and len(s.running) < s.max_num_seqs:
            s.running.append(s.waiting.popleft())
        outs = []
        for r in list(s.running):
            outs.append(self._advance(r))
            if outs[-1].finished:
                s.running.remove(r)
        return outs

    def _advance(self, r) -> RequestOutput:
        p = r["params"]
        if r["tool"] is not None:
            text = r["tool"][r["sent"] : r["sent"] + 8]
            r["sent"] += len(text)
            done = r["sent"] >= len(r["tool"])
            return RequestOutput(r["id"], [0], done, "stop" if done else None, text)
        t = ((p.seed or 0) + r["k"]) % 26
        r["k"] += 1
        done = r["k"] >= p.max_tokens
        lps = None if p.logprobs is None else [(-t / 10, [(t, -t / 10)][: p.logprobs])]
        return RequestOutput(r["id"], [t], done, "length" if done else None, chr(97 + t), lps)


class FakeLLM:
    def __init__(self, max_model_len: int = 256):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.config = dataclasses.make_dataclass("C", [("vocab_size", int)])(VOCAB)
        self.engine = FakeEngine(self.tokenizer)

    def encode_prompt(self, prompt, chat: bool = False) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return prompt_token_ids(ids, VOCAB)
