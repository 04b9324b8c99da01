"""Model runner: scheduled rows -> padded device arrays in fixed buckets -> one jitted model step.

    rows (token ids, start position, block table, sample?)            host, per step
      -> tokens [T], positions [T], slot_mapping [T]                   T from TOKEN_BUCKETS
         block_tables [S, max_blocks], kv_lens [S], cu_q_lens [S+1]    S = max_num_seqs (fixed)
         logits_index [S]                                               last token of each row
      -> step(params, kv_pages, ...) -> logits [S, V], kv_pages        compiled ahead, KV donated
      -> sample(logits, SamplingTensors, ...)                           small jitted sampler

A pure-decode batch uses the paged decode kernel (T = S bucket, one token per row); anything else the ragged
kernel. `decode_loop` runs N decode steps (model + sampling) inside one `lax.fori_loop` per host round trip,
for when no request needs the host between tokens.

Executables are compiled ahead of time by `warmup()` and kept in a dict keyed by bucket; `num_compiles` counts
compilations so tests can check that nothing compiles while serving.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.kv import PagedMeta, init_paged_cache
from model.sampling import SamplingTensors, sample
from model.transformer import Transformer
from pallas_kernels.backend import resolve_backend


@dataclasses.dataclass(frozen=True)
class RowInput:
    """One sequence's work this step."""

    token_ids: Sequence[int]  # tokens to compute, at positions start .. start + len - 1
    start: int
    block_table: Sequence[int]


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out + [hi])


def kv_bytes_per_block(model: Transformer, block_size: int, dtype) -> int:
    cfg = model.cfg
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * jnp.dtype(dtype).itemsize


def size_kv_pool(model: Transformer, block_size: int, dtype, memory_fraction: float, max_blocks: int) -> int:
    """Blocks that fit in `memory_fraction` of the device memory left after loading (GPU); CPU: `max_blocks`."""
    stats = jax.devices()[0].memory_stats() or {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    if not limit:
        return max_blocks
    free = (limit - used) * memory_fraction
    return max(2, int(free // kv_bytes_per_block(model, block_size, dtype)))


class ModelRunner:
    """Owns the parameters, the paged KV cache and the compiled steps.

    Args:
      model: the decoder (its parameters are split out and passed to the compiled steps).
      num_blocks: KV pages in the pool (page 0 is the null page that padding writes to).
      block_size: tokens per page.
      max_num_seqs: S, rows per step.
      max_num_batched_tokens: the largest token bucket.
      max_model_len: longest sequence (sets max_blocks per row).
      attention_backend: kernel backend (None = fastest on the device, "xla" = reference).
      kv_dtype: KV page dtype (default the model's dtype).
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
    ):
        self.cfg = model.cfg
        self.graphdef, self.params = nnx.split(model)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.backend = attention_backend
        self.token_buckets = _pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens)
        self.decode_buckets = _pow2_buckets(1, max_num_seqs)
        # The Pallas kernels walk only each row's live pages, so one table width (max_blocks) serves every step.
        # The XLA reference and the interpreter gather whole table rows, so there the width is bucketed too:
        # a short-context batch then never pays for max_model_len.
        gathers = resolve_backend(attention_backend, "ragged_paged_attention") in ("xla", "interpret")
        self.width_buckets = _pow2_buckets(min(16, self.max_blocks), self.max_blocks) if gathers else (self.max_blocks,)
        self.kv_dtype = kv_dtype or model.dtype
        self.kv_cache = init_paged_cache(
            self.cfg.num_layers, num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim, self.kv_dtype
        )
        self.num_blocks = num_blocks
        self._compiled: dict[tuple, object] = {}
        self.num_compiles = 0

    # Compilation ---------------------------------------------------------------------------------------------

    def _step_fn(self, decode_only: bool):
        graphdef, backend = self.graphdef, self.backend

        def step(params, kv, tokens, positions, slots, block_tables, kv_lens, cu_q_lens, num_seqs, logits_idx):
            model = nnx.merge(graphdef, params)
            meta = PagedMeta(slots, block_tables, kv_lens, cu_q_lens, num_seqs, decode_only, backend)
            logits, kv = model(tokens[None], positions[None], kv, meta, logits_idx[None])
            return logits[0], kv

        return jax.jit(step, donate_argnums=(1,))

    def _loop_fn(self, num_steps: int):
        graphdef, backend, bs = self.graphdef, self.backend, self.block_size

        def loop(params, kv, tokens, positions, block_tables, limits, st: SamplingTensors, banned):
            model = nnx.merge(graphdef, params)
            s = tokens.shape[0]
            rows = jnp.arange(s)
            cu = jnp.arange(s + 1, dtype=jnp.int32)

            def body(i, carry):
                tok, pos, kv, out_tok, out_lp = carry
                active = i < limits  # a row past its own limit (or a padding row, limit 0) writes the null page
                slots = jnp.where(active, block_tables[rows, pos // bs] * bs + pos % bs, 0)
                kv_lens = jnp.where(active, pos + 1, 0)
                meta = PagedMeta(slots, block_tables, kv_lens, cu, jnp.int32(s), True, backend)
                logits, kv = model(tok[None], pos[None], kv, meta, rows[None])
                st_i = dataclasses.replace(st, step=st.step + i)
                new_tok, lp, _, _ = sample(logits[0], st_i, banned_ids_bn=banned[i])
                return new_tok, pos + 1, kv, out_tok.at[i].set(new_tok), out_lp.at[i].set(lp)

            init = (tokens, positions, kv, jnp.zeros((num_steps, s), jnp.int32), jnp.zeros((num_steps, s), jnp.float32))
            _, _, kv, out_tok, out_lp = jax.lax.fori_loop(0, num_steps, body, init)
            return out_tok, out_lp, kv

        return jax.jit(loop, donate_argnums=(1,))

    def _executable(self, key: tuple, build, args):
        exe = self._compiled.get(key)
        if exe is None:
            exe = build().lower(*args).compile()
            self._compiled[key] = exe
            self.num_compiles += 1
        return exe

    def _step_args(self, t: int, s: int, w: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return (i32(t), i32(t), i32(t), i32(s, w), i32(s), i32(s + 1), i32(), i32(s))

    def warmup(self, decode_loop_steps: Sequence[int] = ()) -> int:
        """Compiles every bucket ahead of serving; returns how many executables exist."""
        for w in self.width_buckets:
            for t in self.token_buckets:
                self._get_step(t, self.max_num_seqs, w, decode_only=False)
            for s in self.decode_buckets:
                self._get_step(s, s, w, decode_only=True)
                for n in decode_loop_steps:
                    self._get_loop(n, s, w)
        return len(self._compiled)

    def _get_step(self, t: int, s: int, w: int, decode_only: bool):
        args = (self.params, self.kv_cache) + self._step_args(t, s, w)
        return self._executable(("step", t, s, w, decode_only), lambda: self._step_fn(decode_only), args)

    def _width(self, tables: Sequence[Sequence[int]]) -> int:
        """Smallest table-width bucket holding every row's block table."""
        need = max(len(t) for t in tables)
        return next(w for w in self.width_buckets if w >= need)

    def _get_loop(self, num_steps: int, s: int, w: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        st = SamplingTensors.from_rows([{}] * s)
        st = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), st)
        args = (self.params, self.kv_cache, i32(s), i32(s), i32(s, w), i32(s), st, i32(num_steps, s, self._max_banned))
        return self._executable(("loop", num_steps, s, w), lambda: self._loop_fn(num_steps), args)

    _max_banned = 8

    # Execution -----------------------------------------------------------------------------------------------

    def bucket(self, rows: Sequence[RowInput]) -> tuple[int, int, bool]:
        """(T, S, decode_only) bucket for a batch of rows."""
        n_tok = sum(len(r.token_ids) for r in rows)
        if all(len(r.token_ids) == 1 for r in rows):
            s = next(b for b in self.decode_buckets if b >= len(rows))
            return s, s, True
        t = next((b for b in self.token_buckets if b >= n_tok), None)
        if t is None:
            raise ValueError(f"{n_tok} tokens exceed max_num_batched_tokens {self.token_buckets[-1]}")
        return t, self.max_num_seqs, False

    def prepare(self, rows: Sequence[RowInput]) -> tuple[tuple, tuple[int, int, int, bool]]:
        """Padded host arrays for `rows` (see the module docstring)."""
        if not rows or len(rows) > self.max_num_seqs:
            raise ValueError(f"a step needs 1..{self.max_num_seqs} rows, got {len(rows)}")
        t, s, decode_only = self.bucket(rows)
        w = self._width([r.block_table for r in rows])
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.zeros(t, np.int32)  # padding writes to the null page 0
        tables = np.zeros((s, w), np.int32)
        kv_lens = np.zeros(s, np.int32)
        cu = np.zeros(s + 1, np.int32)
        logits_idx = np.zeros(s, np.int32)
        off = 0
        for i, r in enumerate(rows):
            n = len(r.token_ids)
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
            logits_idx[i] = off - 1
        cu[len(rows) + 1 :] = off
        arrays = (tokens, positions, slots, tables, kv_lens, cu, np.int32(len(rows)), logits_idx)
        return arrays, (t, s, w, decode_only)

    def forward(self, rows: Sequence[RowInput]) -> jax.Array:
        """Runs one step; returns float32 logits [S, V] at each row's last token (rows beyond len(rows): junk)."""
        arrays, (t, s, w, decode_only) = self.prepare(rows)
        exe = self._get_step(t, s, w, decode_only)
        logits, self.kv_cache = exe(self.params, self.kv_cache, *arrays)
        return logits

    def decode_loop(
        self,
        rows: Sequence[RowInput],
        num_steps: int,
        st: SamplingTensors,
        banned: np.ndarray,
        limits: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`num_steps` decode steps on device; row i computes limits[i] (default num_steps) of them and its table
        must cover start + limits[i] positions. Tokens past a row's limit are junk.

        Returns (tokens [num_steps, len(rows)], logprobs [num_steps, len(rows)]).
        """
        s = next(b for b in self.decode_buckets if b >= len(rows))
        w = self._width([r.block_table for r in rows])
        tokens = np.zeros(s, np.int32)
        positions = np.zeros(s, np.int32)
        tables = np.zeros((s, w), np.int32)
        row_limits = np.zeros(s, np.int32)
        row_limits[: len(rows)] = num_steps if limits is None else limits
        for i, r in enumerate(rows):
            tokens[i], positions[i] = r.token_ids[0], r.start
            tables[i, : len(r.block_table)] = r.block_table
        st = pad_sampling(st, s)
        banned_full = np.full((num_steps, s, self._max_banned), -1, np.int32)
        banned_full[:, : len(rows), : banned.shape[-1]] = banned[:, :, : self._max_banned]
        exe = self._get_loop(num_steps, s, w)
        out_tok, out_lp, self.kv_cache = exe(
            self.params, self.kv_cache, tokens, positions, tables, row_limits, st, banned_full
        )
        return np.asarray(out_tok)[:, : len(rows)], np.asarray(out_lp)[:, : len(rows)]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: page dst := page src in every layer."""
        if not pairs:
            return
        # Pad to a power of two with null-page self-copies (page 0 -> page 0) so the copy compiles once per bucket.
        n = 1 << (len(pairs) - 1).bit_length()
        src = jnp.asarray([p[0] for p in pairs] + [0] * (n - len(pairs)), jnp.int32)
        dst = jnp.asarray([p[1] for p in pairs] + [0] * (n - len(pairs)), jnp.int32)
        self.kv_cache = _copy_pages(self.kv_cache, src, dst)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_pages(kv, src, dst):
    return [(k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])) for k, v in kv]


def pad_sampling(st: SamplingTensors, s: int) -> SamplingTensors:
    """Pads every per-row field to S rows (padding rows greedy)."""
    return jax.tree.map(lambda a: np.pad(np.asarray(a), (0, s - len(a))), st)


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample_rows(logits, st, output_ids, prompt_ids, banned, num_logprobs: int = 0):
    """Jitted sampler over the first len(st) rows of logits."""
    return sample(logits[: st.temperature.shape[0]], st, output_ids, prompt_ids, banned, num_logprobs=num_logprobs)
