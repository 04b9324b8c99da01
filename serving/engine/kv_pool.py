"""The paged KV pool: bytes per block, the blocks that fit in the memory left after the weights, and (for MLA
models) its allocation.

    MHA / GQA (model/transformer.py)   per layer (k, v) [Hkv, P, ps, hd]     2 * L * Hkv * hd values per token
    MLA (model/deepseek.py)            per layer (latent,) [1, P, ps, R + Dr]  L * (R + Dr) values per token

An MLA layer caches one row per token, [c_kv | k_rope] (kv_lora_rank + qk_rope_head_dim wide), that every query
head reads: DeepSeek-V3's 576 values per token and layer against 2 * 128 * 128 for its heads uncompressed. The
latent pool has the layout of one KV head's pages, so block tables, copy-on-write, prefix caching and preemption
(all block-level) treat it as any pool.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.deepseek import DeepseekConfig
from model.kv import kv_bytes_per_token_head
from model.mla import init_mla_paged_cache, mla_bytes_per_token
from model.pipeline import num_stages
from model.transformer import Transformer
from serving.config import CPU_MAX_NUM_SEQS
from sharding.mesh import TENSOR
from sharding.rules import kv_cache_heads


def is_latent(cfg) -> bool:
    """Whether a model config caches MLA latents (one row per token and layer) instead of K and V heads."""
    return isinstance(cfg, DeepseekConfig)


def kv_bytes_per_block(model: Transformer, block_size: int, dtype) -> int:
    """Bytes of one block over all layers: K and V pages plus, for int8 / fp8 pages, their float32 scales; or,
    for an MLA model, its latent rows."""
    cfg = model.cfg
    if is_latent(cfg):
        return cfg.num_layers * block_size * mla_bytes_per_token(cfg.mla, dtype)
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * kv_bytes_per_token_head(cfg.head_dim, dtype)


def init_latent_pool(cfg: DeepseekConfig, num_blocks: int, block_size: int, dtype, mesh) -> list[tuple[jax.Array]]:
    """An MLA model's paged pool, one (pages [1, num_blocks, block_size, R + Dr],) per layer, replicated on `mesh`
    (every query head reads every row: under tensor parallelism each device holds it all). Raises ValueError for a
    quantised KV dtype."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    pool = init_mla_paged_cache(cfg.num_layers, num_blocks, block_size, cfg.mla, dtype)
    return [tuple(jax.device_put(a, replicated) for a in layer) for layer in pool]


def _free_bytes(mesh=None) -> tuple[int | None, bool]:
    """(free bytes, whether per device): the free memory of the mesh's first device of this process (a multi-host
    job cannot read the others'), else this host's MemAvailable (Linux; None where unreadable; a CPU's KV pool)."""
    mine = [d for d in (mesh.devices.flat if mesh is not None else ()) if d.process_index == jax.process_index()]
    stats = (mine or jax.local_devices())[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), True
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")), None), False
    except OSError:
        return None, False


def size_kv_pool(model: Transformer, block_size: int, dtype, memory_fraction: float, max_blocks: int, mesh=None) -> int:
    """Blocks that fit in `memory_fraction` of the memory left after loading: accelerators by the device's free
    memory, where a device of `mesh` holds a block's pages for its share of the KV heads (tensor axis) and layers
    (pipeline axis) only (an MLA model's whole latent rows: replicated); a CPU host by its available memory,
    at most `max_blocks` (what the limits can use)."""
    free, per_device = _free_bytes(mesh)
    if free is None:
        return max_blocks
    per_block = kv_bytes_per_block(model, block_size, dtype)
    if mesh is not None and per_device and not is_latent(model.cfg):
        tp, hkv = mesh.shape.get(TENSOR, 1), model.cfg.num_kv_heads
        per_block = per_block * kv_cache_heads(hkv, mesh) // (hkv * tp * num_stages(mesh))
    fit = int(free * memory_fraction // per_block)
    return max(2, fit if per_device else min(max_blocks, fit))


# Batch defaults from memory ---------------------------------------------------------------------------------------

# Tokens each running sequence is given room for when max_num_seqs is chosen from memory (max_model_len if shorter):
# the 1,000-in / 1,000-out workload's longest sequences, so a full batch of them is not preempted.
LIVE_TOKENS_PER_SEQ = 2048
MAX_NUM_SEQS_RANGE = (16, 1024)  # the chosen max_num_seqs is clipped to this
MIN_BATCHED_TOKENS = (256, 2048)  # the step's token budget at least: a CPU host, an accelerator


def default_max_num_seqs(
    device_bytes: int | None,
    weight_bytes: int,
    kv_bytes_per_token: float,
    memory_fraction: float,
    max_model_len: int,
    live_tokens: int = LIVE_TOKENS_PER_SEQ,
) -> int:
    """Sequences to run together when the user sets no max_num_seqs: as many as the KV pool holds at
    min(max_model_len, live_tokens) tokens each, the pool being `memory_fraction` of the accelerator memory left
    after the weights (what size_kv_pool gives it), rounded down to a multiple of 64 from 128 on (a power of two
    below) and clipped to MAX_NUM_SEQS_RANGE. None device_bytes (memory not measured per device: a CPU host): 16.

    Args:
      device_bytes: the memory of the devices that hold one replica, together (bytes_limit x devices), or None.
      weight_bytes: the model's parameters as stored (quantised bytes for quantised weights), all of them.
      kv_bytes_per_token: KV bytes of one token over every layer (kv_bytes_per_block / block_size).
    """
    if device_bytes is None:
        return CPU_MAX_NUM_SEQS
    lo, hi = MAX_NUM_SEQS_RANGE
    pool_tokens = max(0.0, (device_bytes - weight_bytes) * memory_fraction) / kv_bytes_per_token
    fit = int(pool_tokens // max(1, min(max_model_len, live_tokens)))
    fit = fit // 64 * 64 if fit >= 128 else 1 << max(0, fit.bit_length() - 1)
    return int(min(hi, max(lo, fit)))


def default_max_num_batched_tokens(max_num_seqs: int, accelerator: bool) -> int:
    """The step's token budget when the user sets none: room for every running sequence's decode token, and at
    least MIN_BATCHED_TOKENS (256 on a CPU host, 2,048 on an accelerator: prompts enter in few steps)."""
    return max(max_num_seqs, MIN_BATCHED_TOKENS[accelerator])


def _device_bytes(devices: int) -> int | None:
    """bytes_limit of this process's first device x `devices`, or None where it is not reported (a CPU)."""
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    return int(limit) * devices if limit else None


def batch_defaults(config, model: Transformer, kv_dtype):
    """`config` (serving/config.py EngineConfig) with max_num_seqs and max_num_batched_tokens chosen from the
    device memory and the model (default_max_num_seqs, default_max_num_batched_tokens) where the user left them
    unset (None); the options the user set are kept."""
    if config.max_num_seqs is not None and config.max_num_batched_tokens is not None:
        return config
    p = config.parallel
    device_bytes = _device_bytes(p.tp * p.pp * p.ep)
    seqs = config.max_num_seqs
    if seqs is None:
        leaves = jax.tree.leaves(nnx.state(model))
        weight_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
        per_token = kv_bytes_per_block(model, config.block_size, kv_dtype) / config.block_size
        length = config.max_model_len or model.cfg.max_position_embeddings
        seqs = default_max_num_seqs(device_bytes, weight_bytes, per_token, config.kv_cache_memory_fraction, length)
        if config.max_num_batched_tokens is not None:
            seqs = min(seqs, config.max_num_batched_tokens)
    tokens = config.max_num_batched_tokens or default_max_num_batched_tokens(seqs, device_bytes is not None)
    return config.replace(max_num_seqs=seqs, max_num_batched_tokens=tokens)
