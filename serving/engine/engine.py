"""LLMEngine: continuous batching over the paged KV cache.

    add_request(prompt ids, SamplingParams) ---> Scheduler (host, pure Python)
    step():  schedule -> execute -> update -> emit

    schedule   the scheduler picks rows under the token budget (decode rows, verify rows with drafts, prefill
               chunks); copy-on-write pages are copied
    execute    one of: a model step + the sampler (serving/engine/sampler.py), a verify pass (serving/spec/verify.py),
               an on-device speculative loop (serving/spec/device_loop.py), or a decode loop (decode_loop.py), each returning one
               StepResult (per row: tokens, logprobs, positions computed, finish reason)
    update     Scheduler.update: tokens appended, token-level stops (the request's), blocks freed / cached
    emit       the output processor (output.py): detokenisation, text stops (stop strings, grammar verdicts), deltas

A decode loop runs when every scheduled row is a plain decode row and nothing needs the host between its tokens;
with async scheduling its successor is launched from its tokens still on the device before the host reads it, so
the host's update and emit of step N overlap the device's step N + 1.

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

from pallas_kernels.backend import device_supports
from serving.config import KEEP_GGUF, EngineConfig
from serving.core.request import CompletionOutput, Request, RequestOutput, SamplingParams
from serving.core.scheduler import Scheduler
from serving.core.scheduler_output import RowResult, SchedulerOutput, StepResult
from serving.engine.decode_loop import DecodeLoops
from serving.engine.executable_cache import caches_compiled_code
from serving.engine.kv_pool import batch_defaults, kv_bytes_per_block, size_kv_pool
from serving.engine.output import OutputProcessor, Track
from serving.engine.quantize import add_stream_layout, kv_cache_dtype, quantize_model
from serving.engine.runner import ModelRunner, RowInput
from serving.engine.sampler import MAX_BANNED, Sampler, logprob_entry
from serving.engine.structured import StructuredOutputs
from serving.spec.device_loop import SpecLoops
from serving.spec.verify import SpecDecoder, make_spec_decoder
from sharding.config import check_parallel
from sharding.mesh import make_mesh

log = logging.getLogger(__name__)


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
        c = batch_defaults(c, model, kv_dtype)  # max_num_seqs / _batched_tokens unset: from memory
        if c.decode_steps is None:  # a CPU host streams every token; an accelerator keeps 8-step loops (see config)
            c = c.replace(decode_steps=1 if jax.default_backend() == "cpu" else 8)
        self.config = c
        default_blocks = c.usable_kv_blocks(max_model_len)  # a CPU host: what the limits can use, capped by memory

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
            prefill_share_while_waiting=c.prefill_share_while_waiting,
        )
        self._ids = itertools.count()
        self._rng = random.Random(0)
        self.num_steps = 0
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)  # constrained requests
        self.sampler = Sampler(self.runner.decode_buckets, self.structured, self._dead_end)
        self.outputs = OutputProcessor(tokenizer, self.structured, self.scheduler)
        self.loops = DecodeLoops(self.scheduler, self.runner, c.decode_steps, c.max_num_seqs, max_model_len)
        self.spec = make_spec_decoder(c.speculative, model, self.runner, self.scheduler, self.sampler, self.outputs)
        self.spec_loops = SpecLoops(self.spec, self.loops, c.speculative.device_loop)  # drafts on device
        self.overlap = c.async_scheduling
        self._inflight = None  # a decode loop launched but not applied yet
        self._on_device = False  # this step's rows draft inside the on-device speculative loop
        self._queued: jax.Array | None = None  # the last step that sampled nothing (see _bound_run_ahead)
        if c.warmup or (c.warmup is None and jax.default_backend() != "cpu"):
            self.warmup()

    # The parts that hold the scheduler and the runner follow them when they are replaced (tests, multi-host).
    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        for part in self._parts():
            part.scheduler = scheduler

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self._runner = runner
        for part in self._parts():
            if hasattr(part, "runner"):
                part.runner = runner

    @property
    def spec(self) -> SpecDecoder | None:
        return self._spec

    @spec.setter
    def spec(self, spec: SpecDecoder | None) -> None:  # speculation swapped (tests, benchmarks): the loops follow
        self._spec = spec
        if getattr(self, "spec_loops", None) is not None:
            self.spec_loops.spec = spec

    def _parts(self) -> list:
        return [p for p in (getattr(self, n, None) for n in ("outputs", "loops", "_spec")) if p is not None]

    def _dead_end(self, request_id: str, message: str) -> None:
        """A constrained row whose grammar allows no token: finished, so the step's update drops its token."""
        self.scheduler.finish(request_id, "error", message)

    @property
    def loop_in_flight(self) -> bool:
        """Whether a decode loop was launched and is not applied yet (the next step collects it)."""
        return self._inflight is not None

    @property
    def num_decode_loops(self) -> int:
        return self.loops.num_loops

    def warmup(self) -> None:
        """Compiles, before any request, every step bucket, the decode loop and the sampler for every row bucket.

        Greedy and random sampling share one sampler executable per row bucket; the variants with penalties or
        logprobs compile on their first use.
        """
        c = self.config
        # A CPU host compiles slowly: where the attention backend buckets table widths (the interpreter), it warms
        # the narrowest width only, what prompts up to 16 blocks need; wider tables compile in the background.
        widths = self.runner.width_buckets[:1] if jax.default_backend() == "cpu" else None
        t0 = time.perf_counter()

        def progress(done: int, total: int) -> None:
            log.info("warm-up: %d/%d executables compiled (%.0f s)", done, total, time.perf_counter() - t0)

        self.runner.warmup((c.decode_steps,), progress=progress, widths=widths)
        one_process = jax.process_count() == 1  # several: logits reach the sampler from the host (sharding/multihost)
        if self.overlap and one_process:
            self.loops.warm_chain()  # chained loops' token gathers
        if one_process:  # the jit keys on placement: as a step's rows come out of `take_rows`
            r = self.runner
            gathers = sorted(set(r.logit_buckets) | set(r.decode_buckets))  # no table width: cheap on a CPU too
            self.sampler.warmup(r.zero_logits, gathers)  # gathers: of sampled rows out of every logits shape
        else:
            self.sampler.warmup(lambda s: jax.numpy.zeros((s, self.vocab_size), jax.numpy.float32), gather=False)
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
        if params.min_tokens and banned > MAX_BANNED:
            raise ValueError(
                f"min_tokens needs EOS and stop_token_ids banned until then; at most {MAX_BANNED} ids "
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
        self.outputs.add(req, prompt)
        return rid

    def abort(self, request_id: str) -> None:
        """Ends a request (any state) and frees its KV blocks."""
        self.scheduler.abort(request_id)
        self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # The step ------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> update -> emit; returns the per-request deltas it streams.

        A decode loop in flight is collected one call late: the next loop for its rows is launched first (async
        scheduling: the device runs loop N + 1 while the host applies loop N; serving/engine/decode_loop.py).
        """
        out = self._schedule() if self._inflight is None else None  # host: rows, drafts, page copies
        if out is not None and out.is_empty:
            return []
        result = self._execute(out)  # device: one StepResult, whichever way the rows ran
        self.scheduler.update(result)  # host: tokens appended, token stops, blocks freed or cached
        self.num_steps += 1
        return self.outputs.process(result)  # host: detokenisation, text stops, deltas

    def _schedule(self) -> SchedulerOutput:
        self._on_device = self.spec_loops.plan()  # n-gram speculation inside a device loop: no host drafts
        if self.spec is not None and not self._on_device:
            self.spec.before_schedule()  # drafts (or placeholders) for the decode rows
        out = self.scheduler.schedule()
        self.runner.copy_blocks(out.cow_pairs)
        return out

    def _execute(self, out: SchedulerOutput | None) -> StepResult:
        """Runs `out` (None: the loop in flight) and returns its result, or that of the loop it launched before."""
        if out is not None:
            if self._on_device and (result := self.spec_loops.run(out)) is not None:
                return result  # serving/spec/device_loop.py
            if self.spec is not None and self.spec.takes(out):
                return self.spec.step(out)  # one verify pass (serving/spec/verify.py)
            # A one-step loop pays off only chained (its inputs on the device); unchained, the plain step is it.
            limits = self.loops.limits(out) if self.overlap or self.loops.k > 1 else None
            if not limits:
                return self._run_step(out)
            self._inflight = self.loops.launch(out, limits)
        cur = self._inflight
        drafting = self.spec is not None and self.spec.active()  # back to the host: drafts may exist next step
        self._inflight = self.loops.chain(cur) if self.overlap and not drafting else None
        return self.loops.collect(cur)

    def _run_step(self, out: SchedulerOutput) -> StepResult:
        """One model step over every row, then the sampler on the rows that sample."""
        logits = self.runner.forward([RowInput(sr.token_ids, sr.start_pos, sr.block_table) for sr in out.scheduled])
        result = StepResult(out, [RowResult() for _ in out.scheduled])
        index = [i for i, sr in enumerate(out.scheduled) if sr.sample]
        if not index:
            self._bound_run_ahead(logits)
            return result
        self._queued = None  # sampling waits for this step, and with it for every step before it
        reqs = [out.scheduled[i].request for i in index]
        tok, lp, top_ids, top_lp = self.sampler.sample(logits, reqs, index)
        for j, (i, r) in enumerate(zip(index, reqs)):
            row = result.rows[i]
            row.token_ids = [int(tok[j])]
            if r.sampling_params.logprobs is not None:
                row.logprobs = [logprob_entry(r, tok[j], lp[j], top_ids[j], top_lp[j])]
        return result

    def _bound_run_ahead(self, logits: jax.Array) -> None:
        """A step that samples nothing (a prompt's chunk) returns before the device has run it. Unbounded, the host
        would queue every chunk of a long prompt at once, and a request arriving meanwhile would start only after
        all of them: at most one such step waits behind the one running."""
        previous, self._queued = self._queued, logits
        if previous is not None:
            jax.block_until_ready(previous)

    # Outputs -------------------------------------------------------------------------------------------------

    def running(self, request_id: str) -> bool:
        """Whether the request is still being generated (added, not finished or aborted)."""
        return request_id in self.outputs.tracks

    def track(self, request_id: str) -> Track | None:
        """The request's output state (text, timing), running or finished and not yet popped."""
        return self.outputs.track(request_id)

    def pop_finished(self, request_id: str) -> Track | None:
        return self.outputs.pop_finished(request_id)

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
        while any(self.running(rid) for rid in rids):
            self.step()
            if progress is not None:
                report_progress(self, rids, progress)
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


def report_progress(engine, rids: Sequence[str], progress) -> None:
    """progress(finished, total, tokens) over `rids` of an engine (or a data-parallel group of them)."""
    tracks = [engine.track(rid) for rid in rids]
    tokens = sum(len(t.request.output_token_ids) for t in tracks if t is not None)
    progress(sum(not engine.running(rid) for rid in rids), len(rids), tokens)


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


def _executable_dir(compilation_cache_dir: str) -> str | None:
    """Compiled step executables live beside JAX's compilation cache ('' turns both off; a CPU host keeps neither,
    see serving/engine/executable_cache.py caches_compiled_code)."""
    if not compilation_cache_dir or not caches_compiled_code():
        return None
    return os.path.join(os.path.expanduser(compilation_cache_dir), "executables")
