"""Model runner: scheduled rows -> padded device arrays in fixed buckets -> one compiled model step.

    rows (token ids, start position, block table, num_logits)         host, per step
      -> tokens [T], positions [T], slot_mapping [T]                   T from token_buckets
         block_tables [S, W], kv_lens [S], cu_q_lens [S+1]             S = max_num_seqs (decode: a row bucket)
         logits_index [L]                                               each row's last num_logits tokens
      -> step(params, kv_pages, ...) -> logits [L, V], kv_pages        compiled ahead, KV donated
      -> sample(logits, SamplingTensors, ...)                           small jitted sampler

A pure-decode batch uses the paged decode kernel (T = S bucket, one token per row); anything else the ragged
kernel. A verify row (speculative decoding: the last token plus k drafts) is a ragged row of k + 1 tokens whose
logits come back at every one of them (num_logits = k + 1); L is S unless some row asks for more, then the
smallest logit bucket holding them. `decode_loop` runs N decode steps (model + sampling) inside one
`lax.fori_loop` per host round trip; its input tokens may come straight from the previous loop's device output
(`chain`), so the host can schedule and postprocess one loop while the next runs.

Placement: the runner holds a `jax.sharding.Mesh` (one device is a mesh of one, the same code path); parameters
and KV pages are put with the NamedShardings of sharding/rules.py, and every compiled step keeps them there.

Executables are compiled ahead of time by `warmup()` (lowered one by one, compiled in parallel threads) and kept
in a dict keyed by bucket; `num_compiles` counts compilations so tests can check that nothing compiles while
serving.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.deepseek import place_mla
from model.kv import PagedMeta, init_paged_cache
from model.pipeline import copy_stage_pages, init_stage_cache, num_stages, pipelined
from model.sampling import SamplingTensors, pad_sampling, sample
from model.transformer import Transformer
from pallas_kernels.backend import resolve_backend
from serving.engine.executable_cache import ExecutableCache
from serving.engine.kv_pool import (  # noqa: F401  (kv_bytes_per_block, size_kv_pool: their home before kv_pool.py)
    init_latent_pool,
    is_latent,
    kv_bytes_per_block,
    size_kv_pool,
)
from serving.engine.weights import place_on_mesh, swap_params
from sharding.mesh import ParallelConfig, make_mesh
from sharding.rules import kv_cache_heads, kv_cache_sharding

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RowInput:
    """One sequence's work this step."""

    token_ids: Sequence[int]  # tokens to compute, at positions start .. start + len - 1
    start: int
    block_table: Sequence[int]
    num_logits: int = 1  # logits at the last num_logits tokens (a verify row of k drafts: k + 1, all of them)


@dataclasses.dataclass
class LoopInputs:
    """A decode loop's rows already packed to a decode bucket (a persistent batch patched between loops)."""

    tokens: np.ndarray  # [S] int32: each row's input token (a chained row's comes from the device instead)
    positions: np.ndarray  # [S] int32: each row's first position
    tables: np.ndarray  # [S, W] int32: block tables, W a width bucket
    num_rows: int  # rows past it are padding


@dataclasses.dataclass(frozen=True)
class LoopHandle:
    """A dispatched decode loop whose results may still be on their way (nothing here forces a sync)."""

    tokens: jax.Array  # [num_steps, S] int32, device
    logprobs: jax.Array  # [num_steps, S] float32, device
    num_rows: int
    limits: np.ndarray  # [num_rows] tokens each row computes

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [num_steps, num_rows], logprobs [num_steps, num_rows]) on the host (waits for the device)."""
        return np.asarray(self.tokens)[:, : self.num_rows], np.asarray(self.logprobs)[:, : self.num_rows]


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out + [hi])


class ModelRunner:
    """Owns the parameters, the paged KV cache and the compiled steps.

    Args:
      model: the decoder (its parameters are split out, placed on `mesh` and passed to the compiled steps).
      num_blocks: KV pages in the pool (page 0 is the null page that padding writes to), or a function of
        (placed model, mesh) that returns it.
      block_size: tokens per page.
      max_num_seqs: S, rows per step.
      max_num_batched_tokens: the largest token bucket.
      max_model_len: longest sequence (sets max_blocks per row).
      attention_backend: kernel backend (None = fastest on the device, "xla" = reference).
      kv_dtype: KV page dtype (default the model's dtype).
      mesh: where parameters and KV pages live (default: a mesh of the first device).
      max_logits_per_row: the most logits one row may ask for (1 + the most draft tokens of a verify row).
      executable_cache_dir: where compiled executables are stored and loaded (serving/engine/executable_cache.py);
        None: compile every time.
      pipeline_microbatches: microbatches per step on a mesh with pipeline stages (None: one per stage).
    """

    def __init__(
        self,
        model: Transformer,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        attention_backend: str | None = None,
        kv_dtype=None,
        mesh: jax.sharding.Mesh | None = None,
        max_logits_per_row: int = 1,
        executable_cache_dir: str | None = None,
        pipeline_microbatches: int | None = None,
    ):
        self.cfg = model.cfg
        self.mesh = mesh if mesh is not None else make_mesh(ParallelConfig(), devices=jax.devices()[:1])
        self.pipelined = num_stages(self.mesh) > 1  # layers stacked into stages, the KV pool too (model/pipeline.py)
        self.latent = is_latent(self.cfg)  # MLA (model/deepseek.py): its own placement, one latent pool per layer
        model = (place_mla if self.latent else place_on_mesh)(model, self.mesh)  # sharding/rules.py, in place
        model = pipelined(model, self.mesh, pipeline_microbatches) if self.pipelined else model
        self.graphdef, self.params = nnx.split(model)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.backend = attention_backend
        self.token_buckets = _pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens)
        self.decode_buckets = _pow2_buckets(1, max_num_seqs)
        self.max_logits_per_row = max_logits_per_row
        # The Pallas kernels and the XLA path (pallas_kernels/paged_attention_xla.py) walk only each row's live
        # pages, so one table width (max_blocks) serves every step. The interpreter gathers whole table rows, so
        # there the width is bucketed too: a short-context batch then never pays for max_model_len.
        gathers = resolve_backend(attention_backend, "ragged_paged_attention") == "interpret"
        self.width_buckets = _pow2_buckets(min(16, self.max_blocks), self.max_blocks) if gathers else (self.max_blocks,)
        self.dtype, self.kv_dtype = model.dtype, kv_dtype or model.dtype  # compute, KV pages
        if callable(num_blocks):  # sized now that the parameters sit on their devices (the engine's size_kv_pool)
            num_blocks = num_blocks(model, self.mesh)
        kv_heads = kv_cache_heads(self.cfg.num_kv_heads, self.mesh)  # repeated up to tp when fewer (model/kv.py)
        kv_args = (self.cfg.num_layers, num_blocks, block_size, kv_heads, self.cfg.head_dim, self.kv_dtype)
        if self.latent:
            self.kv_cache = init_latent_pool(self.cfg, num_blocks, block_size, self.kv_dtype, self.mesh)
        elif self.pipelined:
            self.kv_cache = init_stage_cache(*kv_args, self.mesh)
        else:
            cache = init_paged_cache(*kv_args)
            self.kv_cache = [
                tuple(jax.device_put(a, kv_cache_sharding(a.shape, self.mesh)) for a in kv) for kv in cache
            ]
        self.num_blocks = num_blocks
        # MoE router load: tokens routed to each expert of each layer [L, E], summed on device over every step.
        self.router_tokens = jnp.zeros((self.cfg.num_layers, self.cfg.num_experts), jnp.int32)
        self._compiled: dict[tuple, object] = {}
        self._cache = ExecutableCache(executable_cache_dir)
        self.num_compiles = 0  # executables made (compiled, or loaded from the executable cache): none while serving

    def set_params(self, params) -> None:
        """Swaps in weights of the same tree, shapes, dtypes and shardings: nothing recompiles; they are copied into
        the old (donated) buffers. serving/engine/weights.py builds them and `swap_params` checks them."""
        self.params = swap_params(self.params, params)

    @property
    def logit_buckets(self) -> tuple[int, ...]:
        """L values of the compiled steps: S, then doubling up to S * max_logits_per_row."""
        s = self.max_num_seqs
        return _pow2_buckets(s, s * self.max_logits_per_row)

    # Compilation ---------------------------------------------------------------------------------------------

    def _step_fn(self, decode_only: bool):
        graphdef, backend, mesh = self.graphdef, self.backend, self.mesh

        def step(params, kv, tokens, positions, slots, block_tables, kv_lens, cu_q_lens, num_seqs, logits_idx):
            model = nnx.merge(graphdef, params)
            meta = PagedMeta(slots, block_tables, kv_lens, cu_q_lens, num_seqs, decode_only, backend, mesh)
            valid = jnp.arange(tokens.shape[0]) < cu_q_lens[-1]  # padding tokens stay out of the router stats
            out = model(tokens[None], positions[None], kv, meta, logits_idx[None], valid[None], True, True)
            return out[0][0], out[1], out[2], out[3][0]  # + hidden states: trained draft heads read them

        return jax.jit(step, donate_argnums=(1,))

    def _loop_fn(self, num_steps: int):
        graphdef, backend, bs, mesh = self.graphdef, self.backend, self.block_size, self.mesh

        def loop(params, kv, tokens, positions, block_tables, limits, st: SamplingTensors, banned):
            model = nnx.merge(graphdef, params)
            s = tokens.shape[0]
            rows = jnp.arange(s)
            cu = jnp.arange(s + 1, dtype=jnp.int32)

            def body(i, carry):
                tok, pos, kv, out_tok, out_lp, routed = carry
                active = i < limits  # a row past its own limit (or a padding row, limit 0) writes the null page
                slots = jnp.where(active, block_tables[rows, pos // bs] * bs + pos % bs, 0)
                kv_lens = jnp.where(active, pos + 1, 0)
                meta = PagedMeta(slots, block_tables, kv_lens, cu, jnp.int32(s), True, backend, mesh)
                logits, kv, counts = model(tok[None], pos[None], kv, meta, rows[None], active[None], True)
                st_i = dataclasses.replace(st, step=st.step + i)
                new_tok, lp, _, _ = sample(logits[0], st_i, banned_ids_bn=banned[i])
                return new_tok, pos + 1, kv, out_tok.at[i].set(new_tok), out_lp.at[i].set(lp), routed + counts

            routed = jnp.zeros((self.cfg.num_layers, self.cfg.num_experts), jnp.int32)
            outs = (jnp.zeros((num_steps, s), jnp.int32), jnp.zeros((num_steps, s), jnp.float32), routed)
            _, _, kv, out_tok, out_lp, routed = jax.lax.fori_loop(0, num_steps, body, (tokens, positions, kv, *outs))
            return out_tok, out_lp, kv, routed

        return jax.jit(loop, donate_argnums=(1,))

    def executable(self, key: tuple, build, args, out_tree=None):
        """The executable for `key`; `args` (abstract arguments, or a function making them) only on a miss."""
        exe = self._compiled.get(key)
        if exe is None:
            args = args() if callable(args) else args
            exe = self.load_from_disk(key, args, out_tree)
            if exe is None:
                exe = build().lower(*args).compile()
                self._cache.store(key, args, self.mesh, exe)
                self.keep(key, exe)
        return exe

    def load_from_disk(self, key: tuple, args, out_tree=None):
        """The executable for `key` from the executable cache (kept), or None; out_tree: its outputs' structure."""
        exe = self._cache.load(key, args, self.mesh, out_tree or self._out_tree(key))
        if exe is not None:
            self.keep(key, exe)
        return exe

    def keep(self, key: tuple, exe) -> None:  # also the warm-ups of loops compiled beside the runner's
        self._compiled[key] = exe
        self.num_compiles += 1

    def store(self, key: tuple, args, exe) -> None:
        """Writes a freshly compiled executable to the executable cache and holds it."""
        self._cache.store(key, args, self.mesh, exe)
        self.keep(key, exe)

    def has_executable(self, key: tuple) -> bool:
        return key in self._compiled

    def _out_tree(self, key: tuple):
        """Output structure of an executable: step -> (logits, kv, router counts, hidden), loop -> (tokens, logprobs,
        kv, router counts)."""
        second = (0, 0, 0) if key[0] == "medusa_loop" else 0  # the medusa loop: (stats, hidden, has_hidden)
        return jax.tree.structure((0, self.kv_cache, 0, 0) if key[0] == "step" else (0, second, self.kv_cache, 0))

    def _step_args(self, t: int, s: int, w: int, n_logits: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return (self.params, self.kv_cache, i32(t), i32(t), i32(t), i32(s, w), i32(s), i32(s + 1), i32(), i32(n_logits))

    def _loop_args(self, num_steps: int, s: int, w: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        st = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), SamplingTensors.from_rows([{}] * s))
        banned = i32(num_steps, s, self._max_banned)
        return (self.params, self.kv_cache, i32(s), i32(s), i32(s, w), i32(s), st, banned)

    def warmup_plan(
        self, decode_loop_steps: Sequence[int] = (), widths: Sequence[int] | None = None
    ) -> list[tuple[tuple, Callable, tuple]]:
        """(key, build, abstract args) of every executable serving can ask for (at the given table widths)."""
        plan = []
        for w in self.width_buckets if widths is None else widths:
            for t in self.token_buckets:
                for n_logits in self.logit_buckets:
                    key = ("step", t, self.max_num_seqs, w, False, n_logits)
                    plan.append(
                        (
                            key,
                            functools.partial(self._step_fn, False),
                            self._step_args(t, self.max_num_seqs, w, n_logits),
                        )
                    )
            for s in self.decode_buckets:
                plan.append(
                    (("step", s, s, w, True, s), functools.partial(self._step_fn, True), self._step_args(s, s, w, s))
                )
                for n in decode_loop_steps:
                    plan.append((("loop", n, s, w), functools.partial(self._loop_fn, n), self._loop_args(n, s, w)))
        return plan

    def warmup(
        self,
        decode_loop_steps: Sequence[int] = (),
        progress: Callable[[int, int], None] | None = None,
        threads: int | None = None,
        widths: Sequence[int] | None = None,
    ) -> int:
        """Compiles every bucket ahead of serving; returns how many executables exist.

        Lowering (Python, holds the GIL) runs one by one; XLA compilation runs in `threads` parallel threads
        (default: half the host's cores, at least 1). progress(done, total) is called after each compilation.
        """
        todo = []
        for key, build, args in self.warmup_plan(decode_loop_steps, widths):
            if key not in self._compiled and self.load_from_disk(key, args) is None:
                todo.append((key, build, args))
        threads = threads or max(1, (os.cpu_count() or 2) // 2)
        t0, done = time.perf_counter(), 0
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = {pool.submit(build().lower(*args).compile): (key, args) for key, build, args in todo}
            for fut in concurrent.futures.as_completed(futures):
                key, args = futures[fut]
                exe = fut.result()
                self.store(key, args, exe)
                done += 1
                if progress is not None:
                    progress(done, len(todo))
        log.info(
            "compiled %d executables in %.1f s (%d threads); %d loaded from the executable cache",
            len(todo),
            time.perf_counter() - t0,
            threads,
            self._cache.hits,
        )
        return len(self._compiled)

    def _get_step(self, t: int, s: int, w: int, decode_only: bool, n_logits: int):
        key = ("step", t, s, w, decode_only, n_logits)
        return self.executable(key, lambda: self._step_fn(decode_only), lambda: self._step_args(t, s, w, n_logits))

    def width(self, tables: Sequence[Sequence[int]]) -> int:
        """Smallest table-width bucket holding every row's block table."""
        need = max(len(t) for t in tables)
        return next(w for w in self.width_buckets if w >= need)

    def _get_loop(self, num_steps: int, s: int, w: int):
        return self.executable(
            ("loop", num_steps, s, w), lambda: self._loop_fn(num_steps), lambda: self._loop_args(num_steps, s, w)
        )

    _max_banned = 8

    # Execution -----------------------------------------------------------------------------------------------

    def bucket(self, rows: Sequence[RowInput]) -> tuple[int, int, bool, int]:
        """(T, S, decode_only, L) bucket for a batch of rows."""
        n_tok = sum(len(r.token_ids) for r in rows)
        if all(len(r.token_ids) == 1 for r in rows):
            s = next(b for b in self.decode_buckets if b >= len(rows))
            return s, s, True, s
        t = next((b for b in self.token_buckets if b >= n_tok), None)
        if t is None:
            raise ValueError(f"{n_tok} tokens exceed max_num_batched_tokens {self.token_buckets[-1]}")
        n_logits = sum(r.num_logits for r in rows)
        lb = next((b for b in self.logit_buckets if b >= n_logits), None)
        if lb is None:
            raise ValueError(f"{n_logits} logits exceed the runner's {self.logit_buckets[-1]} (max_logits_per_row)")
        return t, self.max_num_seqs, False, lb

    def prepare(self, rows: Sequence[RowInput]) -> tuple[tuple, tuple[int, int, int, bool, int]]:
        """Padded host arrays for `rows` (see the module docstring)."""
        if not rows or len(rows) > self.max_num_seqs:
            raise ValueError(f"a step needs 1..{self.max_num_seqs} rows, got {len(rows)}")
        t, s, decode_only, n_logits = self.bucket(rows)
        w = self.width([r.block_table for r in rows])
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.zeros(t, np.int32)  # padding writes to the null page 0
        tables = np.zeros((s, w), np.int32)
        kv_lens = np.zeros(s, np.int32)
        cu = np.zeros(s + 1, np.int32)
        logits_idx = np.zeros(n_logits, np.int32)
        off = n_out = 0
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            if not 1 <= r.num_logits <= n:
                raise ValueError(f"row {i}: num_logits {r.num_logits} must be in 1..{n} (its tokens)")
            pos = np.arange(r.start, r.start + n)
            table = np.asarray(r.block_table, np.int32)
            if len(table) * self.block_size < r.start + n:
                raise ValueError(f"row {i}: block table covers {len(table) * self.block_size} < {r.start + n} tokens")
            tokens[off : off + n] = r.token_ids
            positions[off : off + n] = pos
            slots[off : off + n] = table[pos // self.block_size] * self.block_size + pos % self.block_size
            tables[i, : len(table)] = table
            kv_lens[i] = r.start + n
            off += n
            cu[i + 1] = off
            logits_idx[n_out : n_out + r.num_logits] = np.arange(off - r.num_logits, off)
            n_out += r.num_logits
        cu[len(rows) + 1 :] = off
        arrays = (tokens, positions, slots, tables, kv_lens, cu, np.int32(len(rows)), logits_idx)
        return arrays, (t, s, w, decode_only, n_logits)

    def forward(self, rows: Sequence[RowInput]) -> jax.Array:
        """Runs one step; returns float32 logits [L, V]: row i's num_logits rows first after those of rows < i
        (rows past the sum of num_logits: junk). `last_hidden` [L, D] keeps the hidden states they came from."""
        arrays, (t, s, w, decode_only, n_logits) = self.prepare(rows)
        exe = self._get_step(t, s, w, decode_only, n_logits)
        logits, self.kv_cache, counts, self.last_hidden = exe(self.params, self.kv_cache, *arrays)
        self.count_routed(counts)
        return logits

    def count_routed(self, counts: jax.Array) -> None:
        if self.cfg.is_moe:  # one small device add, no sync
            self.router_tokens = _add(self.router_tokens, counts)

    def router_load(self) -> np.ndarray | None:
        """Tokens routed to each expert of each layer so far [L, E] (None: a dense model), without waiting: while
        the latest sum is still being computed, the previous snapshot is returned."""
        if not self.cfg.is_moe:
            return None
        if self.router_tokens.is_ready() or getattr(self, "_router_host", None) is None:
            self._router_host = np.asarray(self.router_tokens)
        return self._router_host

    def decode_loop(
        self,
        rows: Sequence[RowInput] | LoopInputs,
        num_steps: int,
        st: SamplingTensors,
        banned: np.ndarray,
        limits: np.ndarray | None = None,
        chain: tuple[LoopHandle, Sequence[int]] | None = None,
    ) -> LoopHandle:
        """Dispatches `num_steps` decode steps on device without waiting for them; row i computes limits[i]
        (default num_steps) of them and its table must cover start + limits[i] positions. Tokens past a row's
        limit are junk.

        chain: (previous loop, index of each row in it, or -1): such a row's input token is the last token that
        loop produced for it (still on the device), not rows[i].token_ids[0].
        """
        packed = rows if isinstance(rows, LoopInputs) else self.pack_loop_rows(rows)
        tokens, positions, tables, n = packed.tokens, packed.positions, packed.tables, packed.num_rows
        s = tables.shape[0]
        row_limits = np.zeros(s, np.int32)
        row_limits[:n] = num_steps if limits is None else limits
        st = pad_sampling(st, s) if st.temperature.shape[0] != s else st
        banned_full = np.full((num_steps, s, self._max_banned), -1, np.int32)
        banned_full[:, :n, : banned.shape[-1]] = banned[:, :, : self._max_banned]
        tokens_in = tokens
        if chain is not None:
            prev, index = chain
            idx = np.full(s, -1, np.int32)
            idx[: len(index)] = index
            last = np.where(idx >= 0, prev.limits[np.maximum(idx, 0)] - 1, 0).astype(np.int32)
            tokens_in = chain_tokens(prev.tokens, jnp.asarray(idx), jnp.asarray(last), tokens)
        exe = self._get_loop(num_steps, s, tables.shape[1])
        out_tok, out_lp, self.kv_cache, counts = exe(
            self.params, self.kv_cache, tokens_in, positions, tables, row_limits, st, banned_full
        )
        self.count_routed(counts)
        return LoopHandle(out_tok, out_lp, n, row_limits[:n].copy())

    def pack_loop_rows(self, rows: Sequence[RowInput]) -> LoopInputs:
        """Rows (one token each) packed to their decode bucket and table-width bucket."""
        s = next(b for b in self.decode_buckets if b >= len(rows))
        tokens, positions = np.zeros(s, np.int32), np.zeros(s, np.int32)
        tables = np.zeros((s, self.width([r.block_table for r in rows])), np.int32)
        for i, r in enumerate(rows):
            tokens[i], positions[i] = r.token_ids[0], r.start
            tables[i, : len(r.block_table)] = r.block_table
        return LoopInputs(tokens, positions, tables, len(rows))

    def zero_logits(self, n: int) -> jax.Array:
        """float32 zeros [n, V] placed as the steps return logits (warm-ups: the jit cache keys on placement)."""
        zeros = jnp.zeros((n, self.cfg.vocab_size), jnp.float32)
        return jax.device_put(zeros, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(None, None)))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: page dst := page src in every layer (with its scales, for quantised pages)."""
        if not pairs:
            return
        # Pad to a power of two with null-page self-copies (page 0 -> page 0) so the copy compiles once per bucket.
        n = 1 << (len(pairs) - 1).bit_length()
        src = jnp.asarray([p[0] for p in pairs] + [0] * (n - len(pairs)), jnp.int32)
        dst = jnp.asarray([p[1] for p in pairs] + [0] * (n - len(pairs)), jnp.int32)
        self.kv_cache = (copy_stage_pages if self.pipelined else _copy_pages)(self.kv_cache, src, dst)


@jax.jit
def chain_tokens(prev_tokens, index, last, host_tokens):
    """Input tokens of a chained loop: row i takes prev_tokens[last[i], index[i]] where index[i] >= 0."""
    picked = prev_tokens[last, jnp.maximum(index, 0)]
    return jnp.where(index >= 0, picked, host_tokens)


@jax.jit
def _add(a, b):
    return a + b


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_pages(kv, src, dst):
    """Every array of every layer (pages, and the scales of quantised pages): block dst := block src."""
    return [tuple(a.at[:, dst].set(a[:, src]) for a in layer) for layer in kv]
