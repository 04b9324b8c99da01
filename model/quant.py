"""Quantised weights: one pytree type for every format, and the matmul door the linear layers call.

    QuantizedArray(values, scales, zeros, fmt, group_size)    logical weight [in, out], stored quantised
    matmul(x [..., in], w: QuantizedArray | jax.Array) -> [..., out]   dispatch by w.fmt

Formats (values dtype / scales shape for a logical [K, N] weight):
    "int8"       int8 [K, N]              scales float32 [N]           per output channel, symmetric
    "fp8"        float8_e4m3fn [K, N]     scales float32 [N] or []     per channel or per tensor
    "int4"       uint8 [K // 2, N]        scales float32 [K // g, N]   group-wise along K (g = group_size);
                 (two 4-bit codes a byte: row 2i in the low nibble, 2i+1 in the high)   zeros [K // g, N] or None
                 symmetric: w = (code - 8) * scale; asymmetric: w = (code - zero) * scale

This file holds the data type and the plain-jnp dequantise-then-dot path; the Pallas kernels
(pallas_kernels/quantized_matmul.py) are selected by `matmul` where they exist for the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FORMATS = ("int8", "fp8", "int4")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A weight [K, N] stored quantised (see the module docstring for each format's layout)."""

    values: jax.Array
    scales: jax.Array
    zeros: jax.Array | None = None
    fmt: str = dataclasses.field(default="int8", metadata=dict(static=True))
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantised format {self.fmt!r}; choose one of {FORMATS}")

    @property
    def shape(self) -> tuple[int, int]:
        k, n = self.values.shape[-2:]
        return (2 * k, n) if self.fmt == "int4" else (k, n)

    @property
    def nbytes(self) -> int:
        return sum(int(a.size * a.dtype.itemsize) for a in (self.values, self.scales, self.zeros) if a is not None)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The logical weight [K, N] in `dtype`."""
        if self.fmt in ("int8", "fp8"):
            return (self.values.astype(jnp.float32) * self.scales.astype(jnp.float32)).astype(dtype)
        lo = (self.values & 0xF).astype(jnp.float32)
        hi = (self.values >> 4).astype(jnp.float32)
        k2, n = self.values.shape
        codes = jnp.stack([lo, hi], axis=1).reshape(2 * k2, n)  # row 2i low nibble, 2i+1 high nibble
        g = self.group_size
        zeros = 8.0 if self.zeros is None else jnp.repeat(self.zeros.astype(jnp.float32), g, axis=0)
        return ((codes - zeros) * jnp.repeat(self.scales.astype(jnp.float32), g, axis=0)).astype(dtype)


def reference_matmul(x: jax.Array, w: QuantizedArray) -> jax.Array:
    """x [..., K] @ dequantize(w) [K, N] -> [..., N] in x's dtype, float32 accumulation (the oracle)."""
    wd = w.dequantize(jnp.float32)
    return jnp.einsum("...k,kn->...n", x.astype(jnp.float32), wd, precision="highest").astype(x.dtype)


def matmul(x: jax.Array, w: QuantizedArray | jax.Array, out_dtype=None) -> jax.Array:
    """The door every linear layer goes through: x [..., K] @ w [K, N] -> [..., N] in `out_dtype` (default x's).

    Plain arrays (bf16 / f32) and every quantised format enter here; the implementation is chosen by the format.
    Accumulation is float32; `out_dtype=jnp.float32` keeps it (the LM head's logits).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not isinstance(w, QuantizedArray):
        return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(out_dtype)
    wd = w.dequantize(x.dtype)
    return jnp.einsum("...i,io->...o", x, wd, preferred_element_type=jnp.float32).astype(out_dtype)
