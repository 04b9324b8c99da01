"""LLMEngine: continuous batching over the paged KV cache.

    add_request(prompt ids, SamplingParams) ---> Scheduler (host, pure Python)
    step():  schedule -> prepare + run (ModelRunner, jitted, KV donated) -> sample (device) -> update -> outputs

When every scheduled row is a plain decode row and no request needs the host between tokens (nothing waiting,
no stop strings, penalties or top logprobs), `step` runs `decode_steps` decode iterations inside one jitted loop
and applies them to the scheduler at once.

Generation is single-threaded: callers (LLM.generate, the server's loop) own the thread that calls `step`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from model.sampling import SamplingTensors, pad_sampling
from pallas_kernels.backend import device_supports
from serving.config import KEEP_GGUF, EngineConfig
from serving.core.request import CompletionOutput, Request, RequestOutput, SamplingParams
from serving.core.scheduler import Scheduler, SchedulerOutput
from serving.engine.decode_loop import DecodeLoops, has_penalties
from serving.engine.executable_cache import caches_compiled_code
from serving.engine.quantize import add_stream_layout, kv_cache_dtype, quantize_model
from serving.engine.runner import ModelRunner, RowInput, kv_bytes_per_block, sample_rows, size_kv_pool
from serving.engine.spec_loop import SpecLoops
from serving.engine.speculate import make_spec_decoder
from serving.engine.structured import StructuredOutputs, sample_rows_masked
from sharding.config import check_parallel
from sharding.mesh import make_mesh

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Track:
    """Engine-side state of one request: text, stop strings, timing."""

    request: Request
    prompt: str | None
    detok: object
    text: str = ""
    emitted: int = 0  # characters of text already streamed
    first_token_time: float | None = None
    finish_time: float | None = None


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
      model: the Flax NNX decoder.
      tokenizer: checkpoints.tokenizer.Tokenizer (detokenisation, stop strings).
      config: the validated EngineConfig (serving/config.py); its max_model_len defaults to the model's.
      devices: where the mesh goes (default: the first devices of the job); a data-parallel replica's slice.
    """

    def __init__(self, model, tokenizer, config: EngineConfig, devices: Sequence[jax.Device] | None = None):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a serving.config.EngineConfig, got {type(config).__name__}")
        self.config = c = config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(model.cfg.eos_token_ids)
        self.vocab_size = model.cfg.vocab_size
        self.max_model_len = max_model_len = c.max_model_len or model.cfg.max_position_embeddings
        if c.quantization.method not in (None, KEEP_GGUF):  # weights quantised at load (serving/engine/quantize.py)
            quantize_model(model, c.quantization.method, tokenizer, calibration_file=c.quantization.calibration_file)
            if c.quantization.stream_layout:  # a copy decode can only read through a Mosaic GPU kernel
                if not device_supports("mosaic_gpu"):
                    raise ValueError("quantized_stream_layout needs a GPU that runs Mosaic GPU kernels (Hopper)")
                add_stream_layout(model)
        kv_dtype = kv_cache_dtype(c.kv_cache_dtype, model.dtype)
        default_blocks = max(64, 2 * c.max_num_seqs * -(-min(max_model_len, 2048) // c.block_size))

        def pool_size(placed, mesh) -> int:  # once the weights sit on their devices: each holds its share of KV
            n = size_kv_pool(placed, c.block_size, kv_dtype, c.kv_cache_memory_fraction, default_blocks, mesh)
            if jax.process_count() > 1:  # one pool shape on every host: the smallest fits all
                n = int(np.min(multihost_utils.process_allgather(np.int32(n))))
            return n

        self.runner = ModelRunner(
            model,
            num_blocks=c.num_kv_blocks or pool_size,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=max_model_len,
            attention_backend=c.attention_backend,
            kv_dtype=kv_dtype,
            max_logits_per_row=1 + c.speculative.num_speculative_tokens,  # a verify row: last token + k drafts
            executable_cache_dir=_executable_dir(c.compilation_cache_dir),
            mesh=_mesh(c, model.cfg, devices),
            pipeline_microbatches=c.pipeline_microbatches or None,
        )
        num_blocks = self.runner.num_blocks
        log.info(
            "KV pool: %d blocks of %d tokens = %d tokens (%.2f GB of %s)",
            num_blocks,
            c.block_size,
            (num_blocks - 1) * c.block_size,
            num_blocks * kv_bytes_per_block(model, c.block_size, kv_dtype) / 1e9,
            jax.numpy.dtype(kv_dtype).name,
        )
        self.scheduler = Scheduler(
            num_blocks,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            max_model_len,
            enable_prefix_caching=c.enable_prefix_caching,
            policy=c.policy,
            kv_window=model.cfg.kv_window,
            max_prefill_tokens_while_decoding=c.max_prefill_tokens_while_decoding,
        )
        self._tracks: dict[str, _Track] = {}
        self._finished: dict[str, _Track] = {}
        self._ids = itertools.count()
        self._rng = random.Random(0)
        self.num_steps = 0
        self.loops = DecodeLoops(self, _sampling_tensors)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)  # constrained requests
        self.spec = make_spec_decoder(self, model, _sampling_tensors, _logprob_entry)  # None: speculation off
        self.spec_loops = SpecLoops(self, _sampling_tensors, c.speculative.device_loop)  # drafts on device
        self.overlap = c.async_scheduling
        self._inflight = None  # a decode loop launched but not applied yet
        if c.warmup or (c.warmup is None and jax.default_backend() != "cpu"):
            self.warmup()

    @property
    def num_decode_loops(self) -> int:
        return self.loops.num_loops

    def warmup(self) -> None:
        """Compiles, before any request, every step bucket, the decode loop and the sampler for every row bucket.

        Greedy and random sampling share one sampler executable per row bucket; the variants with penalties or
        logprobs compile on their first use.
        """
        c = self.config
        # A CPU host compiles slowly and gathers whole block tables (one width bucket per table size): it warms the
        # narrowest width only, what prompts up to 16 blocks need; wider tables compile on first use.
        widths = self.runner.width_buckets[:1] if jax.default_backend() == "cpu" else None
        t0 = time.perf_counter()

        def progress(done: int, total: int) -> None:
            log.info("warm-up: %d/%d executables compiled (%.0f s)", done, total, time.perf_counter() - t0)

        self.runner.warmup((c.decode_steps,) if c.decode_steps > 1 else (), progress=progress, widths=widths)
        one_process = jax.process_count() == 1  # several: logits reach `_sample` from the host (sharding/multihost)
        if c.decode_steps > 1 and self.overlap and one_process:
            self.loops.warm_chain()  # chained loops' token gathers
        for s in self.runner.decode_buckets:  # what `_sample` passes: `_take_rows`'s placed [s, V], banned [s, 8]
            if one_process:  # the jit keys on placement: as a step's rows come out of `_take_rows`
                logits = _take_rows(self.runner.zero_logits(s), np.zeros(s, np.int32))
            else:
                logits = jax.numpy.zeros((s, self.vocab_size), jax.numpy.float32)
            banned = np.full((s, _MAX_BANNED), -1, np.int32)
            st = SamplingTensors.from_rows([{}] * s)
            jax.block_until_ready(sample_rows(logits, st, None, None, banned, num_logprobs=0))
            if widths is None:  # the gathers of sampled rows out of every logits shape a step returns (GPU)
                for n in sorted(set(self.runner.logit_buckets) | set(self.runner.decode_buckets)):
                    _take_rows(self.runner.zero_logits(n), np.zeros(s, np.int32))
        if widths is None and self.spec is not None:
            self.spec.warmup()  # the verify pass's acceptance function, per logits and row bucket
        self.spec_loops.warmup(widths)  # the on-device speculative loop, per decode bucket (n-gram only)

    # Requests ------------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queues a request; raises ValueError (with the reason) if it can never be served.

        `params` must be valid: they are checked once, where they enter (LLM.generate, the server's request
        conversion), not here.
        """
        banned = len(params.stop_token_ids) + (0 if params.ignore_eos else len(self.eos_token_ids))
        if params.min_tokens and banned > _MAX_BANNED:
            raise ValueError(
                f"min_tokens needs EOS and stop_token_ids banned until then; at most {_MAX_BANNED} ids "
                f"can be, this request has {banned} (EOS ids: {len(self.eos_token_ids)})"
            )
        bad = [tok for tok, _ in params.logit_bias if tok >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._rng.getrandbits(31))
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids, priority=priority)
        if params.constraint is not None:
            self.structured.compile(params.constraint)  # ValueError before anything is queued
        self.scheduler.add_request(req)
        if params.constraint is not None:
            self.structured.add(rid, params.constraint)
        self._tracks[rid] = _Track(req, prompt, self.tokenizer.detokenizer())
        return rid

    def abort(self, request_id: str) -> None:
        """Ends a request (any state) and frees its KV blocks."""
        if self.scheduler.abort(request_id) is not None:
            self._tracks.pop(request_id, None)
        self.structured.remove(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # The step ------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, update the scheduler, and report per-request deltas.

        A decode loop is applied one call late when the next loop for its rows can be launched first (overlap:
        the device runs loop N+1 while the host applies loop N; serving/engine/decode_loop.py).
        """
        if self._inflight is None:
            on_device = self.spec_loops.plan()  # n-gram speculation inside a device loop: no host drafts
            if self.spec is not None and not on_device:
                self.spec.before_schedule()  # drafts (or placeholders) for the decode rows
            out = self.scheduler.schedule()
            if out.is_empty:
                return []
            self.runner.copy_blocks(out.cow_pairs)
            if on_device and (done := self.spec_loops.run(out)) is not None:
                return self._apply(out, *done)  # serving/engine/spec_loop.py
            if self.spec is not None and self.spec.takes(out):
                return self._apply(out, *self.spec.step(out), None)  # one verify pass (serving/engine/speculate.py)
            limits = self.loops.limits(out)
            if not limits:
                return self._apply(out, *self._run_step(out), None)
            self._inflight = self.loops.launch(out, limits)
        cur = self._inflight
        drafting = self.spec is not None and self.spec.active()  # back to the host: drafts may exist next step
        self._inflight = self.loops.chain(cur) if self.overlap and not drafting else None
        out, sampled, computed = self.loops.collect(cur)
        return self._apply(out, sampled, None, computed)

    def _apply(self, out: SchedulerOutput, sampled: dict, logprobs: dict | None, computed: dict | None):
        finished = self.scheduler.update(out, sampled, logprobs, computed)
        self.num_steps += 1
        return self._postprocess(out, sampled, finished)

    def _rows(self, out: SchedulerOutput) -> list[RowInput]:
        return [RowInput(sr.token_ids, sr.start_pos, sr.block_table) for sr in out.scheduled]

    def _run_step(self, out: SchedulerOutput):
        logits = self.runner.forward(self._rows(out))
        rows = [sr for sr in out.scheduled if sr.sample]
        if not rows:
            return {}, None
        index = [i for i, sr in enumerate(out.scheduled) if sr.sample]
        reqs = [sr.request for sr in rows]
        tok, lp, top_ids, top_lp = self._sample(logits, reqs, index)
        want = any(r.sampling_params.logprobs is not None for r in reqs)
        sampled = {r.request_id: [int(tok[i])] for i, r in enumerate(reqs)}
        logprobs = None
        if want:
            logprobs = {
                r.request_id: [_logprob_entry(r, tok[i], lp[i], top_ids[i], top_lp[i])] for i, r in enumerate(reqs)
            }
        return sampled, logprobs

    def _sample(self, logits, reqs: list[Request], rows: Sequence[int] | None = None):
        """Samples reqs[i] from logits[rows[i]] (rows default: the first len(reqs))."""
        n = len(reqs)
        s = next((b for b in self.runner.decode_buckets if b >= n), n)
        index = np.zeros(s, np.int32)  # padded to the bucket: one gather per (logits bucket, s), none per row count
        index[:n] = np.arange(n) if rows is None else rows
        logits = _take_rows(logits, index)
        st = pad_sampling(_sampling_tensors(reqs), s)
        penalties = any(has_penalties(r.sampling_params) for r in reqs)
        out_ids = _pad_ids([r.output_token_ids for r in reqs], s) if penalties else None
        prompt_ids = _pad_ids([r.prompt_token_ids for r in reqs], s) if penalties else None
        banned = _banned(reqs, s)
        num_lp = max((r.sampling_params.logprobs or 0) for r in reqs)
        num_lp = 0 if num_lp == 0 else (5 if num_lp <= 5 else 20)
        if any(r.sampling_params.logit_bias for r in reqs):
            logits = _add_logit_bias(logits, *_bias_arrays(reqs, s))
        mask, dead = self.structured.bitmask(reqs, s, banned)  # host, while the forward pass runs
        for rid, message in dead.items():  # its token is dropped: update() skips finished requests
            self.scheduler.finish(rid, "error", message)
        if mask is None:
            result = sample_rows(logits, st, out_ids, prompt_ids, banned, num_logprobs=num_lp)
        else:
            result = sample_rows_masked(logits, st, out_ids, prompt_ids, banned, mask, num_logprobs=num_lp)
        return [np.asarray(a)[:n] for a in result]

    # Outputs -------------------------------------------------------------------------------------------------

    def _postprocess(self, out: SchedulerOutput, sampled: dict, finished: list[Request]) -> list[RequestOutput]:
        now = time.perf_counter()
        done = {r.request_id for r in finished}
        results = []
        for sr in out.scheduled:
            rid = sr.request_id
            track = self._tracks.get(rid)
            if track is None or rid not in sampled:
                continue
            req = track.request
            n_new = len(req.output_token_ids) - len(track.detok.ids)
            new_ids = req.output_token_ids[len(track.detok.ids) :]
            if track.first_token_time is None:
                track.first_token_time = now
            stops = req.stop_ids()
            track.text += track.detok.add([t for t in new_ids if t not in stops])
            reason = req.finish_reason if rid in done or req.is_finished else None  # is_finished: dead end
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
            finished_now = reason is not None
            if finished_now and stop_at is None:
                track.text += track.detok.flush()
            hold = 0 if finished_now else max((len(s) - 1 for s in req.sampling_params.stop), default=0)
            visible = len(track.text) - hold
            delta = track.text[track.emitted : visible] if visible > track.emitted else ""
            track.emitted = max(track.emitted, visible)
            lps = req.output_logprobs[-n_new:] if req.sampling_params.logprobs is not None and n_new else None
            message = req.finish_message if finished_now else None
            results.append(RequestOutput(rid, new_ids, finished_now, reason, delta, lps, finish_message=message))
            if finished_now:
                self.structured.remove(rid)
                track.finish_time = now
                self._finished[rid] = self._tracks.pop(rid)
        return results

    def pop_finished(self, request_id: str) -> _Track | None:
        return self._finished.pop(request_id, None)

    # Convenience ---------------------------------------------------------------------------------------------

    def generate(
        self, texts: Sequence[str | None], prompts: Sequence[Sequence[int]], progress=None, **sampling
    ) -> list:
        """Generates for every prompt together; returns serving.engine.llm.CompletionOutput objects in order.

        progress: optional callable(finished, total, tokens), called after every engine step with the number of
        these prompts that have finished, their count, and the tokens generated for them so far.
        """
        base = dict(sampling)
        seed = base.pop("seed", None)
        for key in ("stop", "stop_token_ids"):
            if key in base:
                base[key] = (base[key],) if isinstance(base[key], str) else tuple(base[key] or ())
        rids: list[str] = []
        try:
            for i, ids in enumerate(prompts):
                params = SamplingParams(**base, seed=None if seed is None else seed + i)
                rids.append(self.add_request(ids, params, prompt=texts[i]))
        except (ValueError, TypeError):
            for rid in rids:  # all or nothing: a rejected prompt leaves no half-submitted batch behind
                self.abort(rid)
            raise
        t0 = time.perf_counter()
        while any(rid in self._tracks for rid in rids):
            self.step()
            if progress is not None:
                self._report_progress(rids, progress)
        results = []
        for text, ids, rid in zip(texts, prompts, rids):
            track = self.pop_finished(rid)
            req = track.request
            gen = list(req.output_token_ids)
            metrics = {"ttft_s": (track.first_token_time or t0) - t0, "e2e_s": track.finish_time - t0}
            decode_time = track.finish_time - (track.first_token_time or track.finish_time)
            if len(gen) > 1 and decode_time > 0:
                metrics["decode_tokens_per_s"] = (len(gen) - 1) / decode_time
            lps = [e[0] if isinstance(e, tuple) else e for e in req.output_logprobs] or None
            results.append(
                CompletionOutput(text, list(ids), track.text, gen, req.finish_reason, lps, metrics, req.finish_message)
            )
        return results

    def _report_progress(self, rids: Sequence[str], progress) -> None:
        tracks = [self._tracks.get(rid) or self._finished.get(rid) for rid in rids]
        tokens = sum(len(t.request.output_token_ids) for t in tracks if t is not None)
        progress(sum(rid not in self._tracks for rid in rids), len(rids), tokens)


def _mesh(c: EngineConfig, model_cfg, devices=None) -> jax.sharding.Mesh:
    """The runner's mesh from the parallel degrees (refused with the wrong flag named when the model cannot split),
    over `devices` (a data-parallel replica's slice) or the first devices of the job."""
    check_parallel(c.parallel, model_cfg, jax.device_count() if devices is None else len(devices))
    if c.parallel.dp > 1:
        raise ValueError(
            f"data_parallel_size={c.parallel.dp}: one LLMEngine is one replica; serving/engine/data_parallel.py "
            "make_engine builds the replicas"
        )
    return make_mesh(c.parallel, devices=(jax.devices() if devices is None else devices)[: c.parallel.num_devices])


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _sampling_tensors(reqs: Sequence[Request], ahead: Sequence[int] | int = 0) -> SamplingTensors:
    """Per-row sampling parameters; `ahead`: tokens each row is past its request's state (a chained loop).

    Built column-wise from one tuple per row (one numpy conversion per dtype): this runs before every decode loop
    and verify pass, and a dict per row with a lookup per field cost ~30% of the host's work per loop at batch 64.
    """
    ahead = [ahead] * len(reqs) if isinstance(ahead, int) else ahead
    ps = [r.sampling_params for r in reqs]
    f = np.array(
        [(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in ps],
        np.float32,
    ).reshape(len(ps), 6)
    return SamplingTensors(
        temperature=f[:, 0],
        top_k=np.array([p.top_k for p in ps], np.int32),
        top_p=f[:, 1],
        min_p=f[:, 2],
        repetition_penalty=f[:, 3],
        presence_penalty=f[:, 4],
        frequency_penalty=f[:, 5],
        seed=np.array([p.seed % (2**32) for p in ps], np.uint32),
        step=np.array([r.num_output_tokens + a for r, a in zip(reqs, ahead)], np.int32),
    )


@jax.jit
def _take_rows(logits_lv: jax.Array, index_s: jax.Array) -> jax.Array:
    return jax.numpy.take(logits_lv, index_s, axis=0)  # [s, V]


def _pad_ids(lists: Sequence[Sequence[int]], s: int) -> np.ndarray:
    width = 1 << max(4, (max((len(x) for x in lists), default=1) - 1).bit_length())
    out = np.full((s, width), -1, np.int32)
    for i, ids in enumerate(lists):
        out[i, : len(ids)] = ids
    return out


_MAX_BANNED = 8  # token ids banned per row before min_tokens (EOS + stop ids); more are not enforced


def _banned(reqs: Sequence[Request], s: int) -> np.ndarray:
    """EOS and stop ids are banned for rows that have not reached min_tokens."""
    out = np.full((s, _MAX_BANNED), -1, np.int32)
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            out[i, : min(_MAX_BANNED, len(ids))] = ids[:_MAX_BANNED]
    return out


def _logprob_entry(req: Request, token, lp, top_ids, top_lp):
    n = req.sampling_params.logprobs or 0
    return (float(lp), [(int(i), float(v)) for i, v in zip(top_ids[:n], top_lp[:n])])


def _executable_dir(compilation_cache_dir: str) -> str | None:
    """Compiled step executables live beside JAX's compilation cache ('' turns both off; a CPU host keeps neither,
    see serving/engine/executable_cache.py caches_compiled_code)."""
    if not compilation_cache_dir or not caches_compiled_code():
        return None
    return os.path.join(os.path.expanduser(compilation_cache_dir), "executables")


def _bias_arrays(reqs: Sequence[Request], s: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [s, N], biases [s, N]) of every row's logit_bias, N a power of two; padding adds 0 to token 0."""
    width = 1 << max(3, (max(len(r.sampling_params.logit_bias) for r in reqs) - 1).bit_length())
    ids = np.zeros((s, width), np.int32)
    vals = np.zeros((s, width), np.float32)
    for i, r in enumerate(reqs):
        for j, (tok, bias) in enumerate(r.sampling_params.logit_bias):
            ids[i, j], vals[i, j] = tok, bias
    return ids, vals


@jax.jit
def _add_logit_bias(logits, ids, vals):
    """logits [s, V] + each row's sparse bias (OpenAI logit_bias), before any other processing."""
    rows = jax.numpy.arange(ids.shape[0])[:, None]
    return logits.at[rows, ids].add(vals.astype(logits.dtype))
