"""Named attention workload shapes shared by tests, benchmarks and tuning (one place, so they cannot drift).

`BENCH_*` are the sizes the device benchmarks report; `TEST_*` are the shapes that break kernels (lengths
that do not divide a tile, a single token, GQA ratios that do not divide the tile) kept small enough for the
Pallas interpreter on a CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One attention problem: q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]."""

    name: str
    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: Hq={self.num_q_heads} is not a multiple of Hkv={self.num_kv_heads}")

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.q_len, self.num_q_heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_len, self.num_kv_heads, self.head_dim)

    def forward_flops(self) -> float:
        """Matmul FLOPs of the forward: 4*B*Hq*Tq*Tk*D (two products), halved when causal and Tq == Tk."""
        flops = 4.0 * self.batch * self.num_q_heads * self.q_len * self.kv_len * self.head_dim
        return flops / 2 if self.causal and self.q_len == self.kv_len else flops

    def backward_flops(self) -> float:
        """The usual convention: the backward's five products cost 2.5x the forward's two."""
        return 2.5 * self.forward_flops()

    def make_inputs(self, seed: int = 0):
        """Random normal (q, k, v) in `dtype`; fresh draws per seed (never zeros: they hide unwritten tiles)."""
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        dtype = jnp.dtype(self.dtype)
        return (
            jax.random.normal(kq, self.q_shape, dtype),
            jax.random.normal(kk, self.kv_shape, dtype),
            jax.random.normal(kv, self.kv_shape, dtype),
        )


def _bench(name: str, batch: int, seq: int, causal: bool) -> AttentionShape:
    return AttentionShape(name, batch, seq, seq, 32, 32, 128, causal=causal)


# Device benchmark shapes (benchmarks/kernels_flash.py): Llama-7B-like heads.
BENCH_FLASH = (
    _bench("b4_s4096_h32_d128_causal", 4, 4096, True),
    _bench("b4_s4096_h32_d128_full", 4, 4096, False),
    _bench("b1_s16384_h32_d128_causal", 1, 16384, True),
    _bench("b1_s16384_h32_d128_full", 1, 16384, False),
)

# Shapes that break kernels, small enough for the interpreter (tests/test_flash_attention.py).
TEST_FLASH = (
    AttentionShape("len1", 1, 1, 1, 2, 1, 64),
    AttentionShape("len3_gqa3", 1, 3, 3, 3, 1, 64),
    AttentionShape("len127_mha", 1, 127, 127, 2, 2, 128),
    AttentionShape("len513_gqa4", 1, 513, 513, 4, 1, 64),
    AttentionShape("len127_gqa8_d256", 1, 127, 127, 8, 1, 256),
    AttentionShape("len1023_gqa2", 1, 1023, 1023, 2, 1, 128),
    AttentionShape("chunk_q40_kv200", 2, 40, 200, 4, 2, 64),  # q_offset = 160: a chunk at the end of the KV
)

BY_NAME = {shape.name: shape for shape in BENCH_FLASH + TEST_FLASH}
