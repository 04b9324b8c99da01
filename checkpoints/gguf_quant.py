"""GGUF Q8_0 / Q4_0 / Q4_1 linear weights -> QuantizedArray (model/quant.py) without dequantising.

ggml stores a linear weight as rows [out, in] (ne0 = in), each row in blocks of 32 inputs:

    Q8_0  f16 d, int8 q[32]            w = q * d
    Q4_0  f16 d, u8 qs[16]             w = (q - 8) * d              q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4
    Q4_1  f16 d, f16 m, u8 qs[16]      w = q * d + m

Mapping onto our formats (logical [in, out] = [K, N], groups of 32 along K):

    Q8_0 -> "int8", group_size 32, scales [K/32, N]                          (exact: the same codes and scales)
    Q4_0 -> "int4" symmetric, group 32: w = (code - 8) * scale              (exact)
    Q4_1 -> "int4" asymmetric, group 32, float zero points zero = -m / d:  (code - zero) * d = code * d + m
            (equal up to float32 rounding of m / d * d; a block with d = 0 is constant m: scale 1, zero -m, codes 0)

Codes are only moved (nibbles repacked to our row-pair layout, rows of q/k unpermuted like the float path in
checkpoints/gguf.py); scales and zero points are float32.
"""

from __future__ import annotations

import numpy as np

from model.quant import QuantizedArray

BLOCK = 32
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
QUANTIZED_TYPES = frozenset(_BLOCK_BYTES)


def _blocks(data: np.ndarray, type_name: str, shape_ne: tuple[int, int]) -> np.ndarray:
    """Raw tensor bytes -> [N, K/32, block bytes] uint8 (shape_ne = (K, N), ggml's ne0 first)."""
    k, n = shape_ne
    if k % BLOCK:
        raise ValueError(f"{type_name} tensor with row length {k}, not a multiple of {BLOCK}")
    return np.ascontiguousarray(np.asarray(data, np.uint8)).reshape(n, k // BLOCK, _BLOCK_BYTES[type_name])


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian f16)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[N, nb, 16] uint8 -> codes [N, nb * 32]: element j the low nibble of byte j, element j + 16 the high."""
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    return codes.reshape(qs.shape[0], -1)


def decode_blocks(data: np.ndarray, type_name: str, shape_ne: tuple[int, int]) -> dict[str, np.ndarray]:
    """Codes [N, K] and per-block scales (and mins) [N, K/32] of a Q8_0 / Q4_0 / Q4_1 tensor, ggml row order."""
    raw = _blocks(data, type_name, shape_ne)
    out = {"d": _f16(raw[..., 0:2])}
    if type_name == "Q8_0":
        out["codes"] = raw[..., 2:].view(np.int8).reshape(raw.shape[0], -1)
    elif type_name == "Q4_0":
        out["codes"] = _nibbles(raw[..., 2:])
    else:
        out["m"] = _f16(raw[..., 2:4])
        out["codes"] = _nibbles(raw[..., 4:])
    return out


def pack_rows(codes_kn: np.ndarray) -> np.ndarray:
    """codes [K, N] in 0..15 -> uint8 [K/2, N]: row 2i in the low nibble, 2i+1 in the high (model/quant.py)."""
    c = codes_kn.astype(np.uint8)
    return c[0::2] | (c[1::2] << 4)


def to_quantized(data, type_name: str, shape_ne: tuple[int, int], row_permute=None) -> QuantizedArray:
    """One ggml [out, in] Q8_0 / Q4_0 / Q4_1 weight as a QuantizedArray of the logical [in, out] weight.

    row_permute: optional function applied to [out, ...] arrays (llama.cpp's q/k row permutation undone).
    """
    import jax.numpy as jnp

    if type_name not in QUANTIZED_TYPES:
        raise ValueError(f"ggml type {type_name} has no quantised mapping; one of {sorted(QUANTIZED_TYPES)}")
    parts = decode_blocks(data, type_name, shape_ne)
    if row_permute is not None:
        parts = {k: row_permute(v) for k, v in parts.items()}
    d, codes = parts["d"], parts["codes"]
    if type_name == "Q8_0":
        return QuantizedArray(jnp.asarray(codes.T), jnp.asarray(d.T), fmt="int8", group_size=BLOCK)
    values = jnp.asarray(pack_rows(codes.T))
    if type_name == "Q4_0":
        return QuantizedArray(values, jnp.asarray(d.T), fmt="int4", group_size=BLOCK)
    m = parts["m"]
    flat = d == 0  # a constant block (all codes 0 in llama.cpp's quantiser): w = (0 - (-m)) * 1
    scale = np.where(flat, np.float32(1.0), d)
    zero = np.where(flat, -m, -m / scale).astype(np.float32)
    return QuantizedArray(values, jnp.asarray(scale.T), jnp.asarray(zero.T), fmt="int4", group_size=BLOCK)


def dequantize(data: np.ndarray, type_name: str, chunk_blocks: int = 1 << 15) -> np.ndarray:
    """A Q8_0 / Q4_0 / Q4_1 tensor's bytes [..., row bytes] -> float32 [..., row length], bit for bit what the
    `gguf` package's dequantize returns (the same float32 products and sums), a few times faster: whole chunks of
    blocks at a time, written in place into one output buffer."""
    if type_name not in QUANTIZED_TYPES:
        raise ValueError(f"ggml type {type_name}: not one of {sorted(QUANTIZED_TYPES)}")
    raw = np.asarray(data, np.uint8)
    nbytes = _BLOCK_BYTES[type_name]
    if raw.shape[-1] % nbytes:
        raise ValueError(f"{type_name} rows of {raw.shape[-1]} bytes, not a multiple of {nbytes}")
    blocks = np.ascontiguousarray(raw).reshape(-1, nbytes)
    out = np.empty((blocks.shape[0], BLOCK), np.float32)
    for i in range(0, blocks.shape[0], chunk_blocks):
        b, o = blocks[i : i + chunk_blocks], out[i : i + chunk_blocks]
        d = _f16(b[:, 0:2])[:, None]
        if type_name == "Q8_0":
            o[:] = b[:, 2:].view(np.int8)
            o *= d
            continue
        qs = b[:, 4:] if type_name == "Q4_1" else b[:, 2:]
        np.bitwise_and(qs, 0xF, out=o[:, : BLOCK // 2], casting="unsafe")
        np.right_shift(qs, 4, out=o[:, BLOCK // 2 :], casting="unsafe")
        if type_name == "Q4_0":
            o -= np.float32(8)
        o *= d
        if type_name == "Q4_1":
            o += _f16(b[:, 2:4])[:, None]
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes * BLOCK)


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor (checkpoints/gguf_file.py) as float32: Q8_0 / Q4_0 / Q4_1 by `dequantize` (bit-identical and
    faster), the other ggml types (F16, BF16, K-quants, MXFP4, ...) by the `gguf` package."""
    from gguf import quants

    if tensor.tensor_type.name in QUANTIZED_TYPES:
        return dequantize(tensor.data, tensor.tensor_type.name)
    try:
        data = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name}: ggml type {tensor.tensor_type.name} is not supported") from e
    return np.asarray(data, dtype=np.float32)
