"""One launch of each paged kernel on the ragged mix, for Nsight Compute (occupancy, registers, SMEM, bandwidth).

    ncu --clock-control none -k regex:"ragged|paged" --section LaunchStats --section Occupancy \
        --section SpeedOfLight python3 benchmarks/profile_paged_ncu.py

Runs, once each (compile, then a single launch): the ragged kernel on the mixed batch of
benchmarks/kernels_paged.py (4 x 512-token chunks + 60 decode rows, ctx 2048), the ragged kernel on the 60 decode
rows alone, and the decode kernel (paged_attention) on the same 60 rows. The numbers explain why the one launch
streams its decode tiles at half the decode kernel's bandwidth (paged_notes.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.kernels_paged import ragged_inputs
from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa


def main():
    args, chunks, chunk_len = ragged_inputs(jax.random.key(11))
    q, k_pages, v_pages, block_tables, kv_lens, cu, num_seqs = args
    n_pre, n_live = chunks * chunk_len, int(cu[-1])
    decodes = int(num_seqs) - chunks
    ragged = jax.jit(lambda *a: rpa.ragged_paged_attention(*a, backend="triton"))
    decode = jax.jit(lambda *a: pa.paged_attention(*a, backend="triton"))
    dec_only = (
        q[n_pre:n_live],
        k_pages,
        v_pages,
        block_tables[chunks:],
        kv_lens[chunks:],
        cu[chunks:] - cu[chunks],
        jnp.int32(decodes),
    )
    for name, fn, a in (
        ("ragged mixed", ragged, args),
        ("ragged decode rows only", ragged, dec_only),
        ("paged_attention decode rows", decode, dec_only[:5]),
    ):
        jax.block_until_ready(fn(*a))
        print(f"launched: {name}", flush=True)


if __name__ == "__main__":
    main()
