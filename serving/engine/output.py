"""The output processor: a step's tokens -> streamed text deltas, with every text-level stop decided here.

    StepResult (after Scheduler.update: the tokens each request took, token stops set) -> per request:
        incremental detokenisation (stop ids never reach the text)
        grammar verdict (structured.advance: the grammar is complete, or refused a token)  -> finish 'stop' / 'error'
        stop strings (the text is cut where the first one starts)                            -> finish 'stop'
        the delta to stream (holding back what could still become a stop string)        -> RequestOutput

Token-level stops (EOS, stop ids, max_tokens, the context length) are the request's (`Request.first_stop`, applied
by `Scheduler.update`); a text stop found here finishes the request in the scheduler. The speculative paths ask
`stop_prefix` how many of a row's emitted tokens to keep, so their tokens past a stop string never reach the
request.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence

from serving.core.request import Request, RequestOutput
from serving.core.scheduler_output import StepResult
from serving.engine.structured import StructuredOutputs


@dataclasses.dataclass
class Track:
    """Output-side state of one request: text, stop strings, timing."""

    request: Request
    prompt: str | None
    detok: object
    text: str = ""
    emitted: int = 0  # characters of text already streamed
    first_token_time: float | None = None
    finish_time: float | None = None


class OutputProcessor:
    """Detokenises, applies text stops and builds each step's RequestOutputs.

    Args:
      tokenizer: checkpoints.tokenizer.Tokenizer (its incremental detokenizer).
      structured: the grammars of constrained requests (their verdicts finish requests here).
      scheduler: finishes requests on a text stop (assignable: the engine keeps it current).
    """

    def __init__(self, tokenizer, structured: StructuredOutputs, scheduler):
        self.tokenizer = tokenizer
        self.structured = structured
        self.scheduler = scheduler
        self.tracks: dict[str, Track] = {}  # requests not finished yet
        self.finished: dict[str, Track] = {}  # finished, until their owner pops them

    def add(self, req: Request, prompt: str | None) -> None:
        self.tracks[req.request_id] = Track(req, prompt, self.tokenizer.detokenizer())

    def abort(self, request_id: str) -> None:
        self.tracks.pop(request_id, None)
        self.structured.remove(request_id)

    def pop_finished(self, request_id: str) -> Track | None:
        return self.finished.pop(request_id, None)

    def track(self, request_id: str) -> Track | None:
        """The request's track, running or finished (not yet popped)."""
        return self.tracks.get(request_id) or self.finished.get(request_id)

    def process(self, result: StepResult) -> list[RequestOutput]:
        """One RequestOutput per row of a live request that took tokens or finished this step."""
        now = time.perf_counter()
        outputs = []
        for sr, row in result:
            track = self.tracks.get(sr.request_id)
            if track is None or not (sr.sample or row.token_ids):
                continue
            outputs.append(self._emit(track, row, now))
        return outputs

    def _emit(self, track: Track, row, now: float) -> RequestOutput:
        req, rid = track.request, track.request.request_id
        new_ids = req.output_token_ids[len(track.detok.ids) :]
        if track.first_token_time is None:
            track.first_token_time = now
        stops = req.stop_ids()
        track.text += track.detok.add([t for t in new_ids if t not in stops])
        reason = req.finish_reason if req.is_finished else None  # a token stop, or a dead end at sampling
        verdict = self.structured.advance(req, new_ids) if reason is None else None
        if verdict is not None:  # the grammar is complete ('stop') or refused a token (a message)
            reason = "stop" if verdict == "stop" else "error"
            self.scheduler.finish(rid, reason, None if reason == "stop" else verdict)
        stop_at = _find_stop(track.text, req.sampling_params.stop)
        if reason is None and stop_at is not None:
            self.scheduler.finish(rid, "stop")
            reason = "stop"
        if stop_at is not None:
            track.text = track.text[:stop_at]
        row.finish_reason = reason
        finished = reason is not None
        if finished and stop_at is None:
            track.text += track.detok.flush()
        hold = 0 if finished else max((len(s) - 1 for s in req.sampling_params.stop), default=0)
        visible = len(track.text) - hold
        delta = track.text[track.emitted : visible] if visible > track.emitted else ""
        track.emitted = max(track.emitted, visible)
        n_new = len(new_ids)
        lps = req.output_logprobs[-n_new:] if req.sampling_params.logprobs is not None and n_new else None
        message = req.finish_message if finished else None
        if finished:
            self.structured.remove(rid)
            track.finish_time = now
            self.finished[rid] = self.tracks.pop(rid)
        return RequestOutput(rid, new_ids, finished, reason, delta, lps, finish_message=message)

    def stop_prefix(self, req: Request, emitted: Sequence[int]) -> int:
        """How many of `emitted` (tokens a speculative pass would append) to keep: up to the one that completes a
        stop string (the request then finishes on it here), else all."""
        stops = req.sampling_params.stop
        track = self.tracks.get(req.request_id)
        if not stops or track is None or len(emitted) == 1:
            return len(emitted)
        detok = copy.copy(track.detok)
        detok.ids = list(track.detok.ids)
        text = track.text
        stop_ids = req.stop_ids()
        for j, t in enumerate(emitted):
            if t not in stop_ids:
                text += detok.add([t])
            if any(s and s in text for s in stops):
                return j + 1
        return len(emitted)


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
