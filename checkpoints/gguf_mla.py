"""deepseek2 GGUF tensors -> the parameter slots of model/deepseek.py's DeepseekModel (MLA, MoE, shared experts).

checkpoints/gguf.py reads the config (checkpoints/gguf_arch.py `_deepseek2`); this maps llama.cpp's tensors onto
the slots checkpoints/deepseek_hf.py fills from safetensors, so `build_deepseek` takes either. Each ggml tensor is
dequantised to float32 ([out, in] rows) and transposed to our [in, out]; fused slots are joined from their parts:

    blk.N.attn_q_a | attn_q, attn_kv_a_mqa          -> layers.N.attn.w_a [D, q_a + R + Dr]
    blk.N.attn_k_b [H, R, dn], attn_v_b [H, dv, R]   -> layers.N.attn.w_kv_b [R, H (dn + dv)]   (llama.cpp's MLA split,
        or attn_kv_b [H (dn + dv), R] whole, as files written before it hold it)
    blk.N.ffn_{gate,up} (dense), ffn_{gate,up}_shexp -> mlp.w_gate_up, mlp.shared.w_gate_up   [D, 2F]
    blk.N.ffn_{gate,up}_exps [E, F, D] (or ffn_gate_up_exps [E, 2F, D]) -> mlp.w_gate_up [E, D, 2F]
    blk.N.ffn_gate_inp [E, D], exp_probs_b.bias [E]  -> mlp.w_router [D, E], mlp.router_bias

A V3-routed (sigmoid) file without exp_probs_b gets a zero bias, as llama.cpp treats the tensor as optional.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from checkpoints.gguf_quant import dequantize_tensor as _dequantize

# GGUF suffix after "blk.N." -> (slot under "layers.N.", part key, transpose). Parts of one slot are joined.
_LAYER = {
    "attn_norm.weight": ("attn_norm.weight", 0, False),
    "ffn_norm.weight": ("mlp_norm.weight", 0, False),
    "attn_q_a.weight": ("attn.w_a", 0, True),
    "attn_q.weight": ("attn.w_a", 0, True),
    "attn_kv_a_mqa.weight": ("attn.w_a", 1, True),
    "attn_q_a_norm.weight": ("attn.q_a_norm.weight", 0, False),
    "attn_q_b.weight": ("attn.w_q_b", 0, True),
    "attn_kv_a_norm.weight": ("attn.kv_a_norm.weight", 0, False),
    "attn_kv_b.weight": ("attn.w_kv_b", 0, True),
    "attn_k_b.weight": ("attn.w_kv_b", "k_b", False),
    "attn_v_b.weight": ("attn.w_kv_b", "v_b", False),
    "attn_output.weight": ("attn.w_o", 0, True),
    "ffn_gate.weight": ("mlp.w_gate_up", 0, True),
    "ffn_up.weight": ("mlp.w_gate_up", 1, True),
    "ffn_down.weight": ("mlp.w_down", 0, True),
    "ffn_gate_inp.weight": ("mlp.w_router", 0, True),
    "exp_probs_b.bias": ("mlp.router_bias", 0, False),
    "ffn_gate_exps.weight": ("mlp.w_gate_up", 0, True),
    "ffn_up_exps.weight": ("mlp.w_gate_up", 1, True),
    "ffn_gate_up_exps.weight": ("mlp.w_gate_up", 0, True),
    "ffn_down_exps.weight": ("mlp.w_down", 0, True),
    "ffn_gate_shexp.weight": ("mlp.shared.w_gate_up", 0, True),
    "ffn_up_shexp.weight": ("mlp.shared.w_gate_up", 1, True),
    "ffn_down_shexp.weight": ("mlp.shared.w_down", 0, True),
}
_GLOBAL = {
    "token_embd.weight": ("embed.weight", False),
    "output_norm.weight": ("final_norm.weight", False),
    "output.weight": ("lm_head", True),
}


def _read(tensor, transpose: bool) -> np.ndarray:
    x = _dequantize(tensor)
    return np.swapaxes(x, -1, -2) if transpose else x


def _kv_b(k_b, v_b) -> np.ndarray:
    """llama.cpp's split halves back into w_kv_b [R, H (dn + dv)]: per head [k_nope | v] columns."""
    k = np.swapaxes(_dequantize(k_b), 1, 2)  # [H, R, dn] -> [H, dn, R]
    kv = np.concatenate([k, _dequantize(v_b)], axis=1)  # [H, dn + dv, R]
    return np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]).T)


def _join(parts: dict) -> np.ndarray:
    """One slot from its parts {key: (tensor, transpose)}: [part 0 | part 1] along the last axis, or k_b / v_b."""
    if "k_b" in parts or "v_b" in parts:
        if set(parts) != {"k_b", "v_b"}:
            raise ValueError(f"deepseek2 GGUF: attn_k_b and attn_v_b come together; found only {sorted(parts)}")
        return _kv_b(parts["k_b"][0], parts["v_b"][0])
    values = [_read(*parts[k]) for k in sorted(parts)]
    return np.ascontiguousarray(np.concatenate(values, axis=-1) if len(values) > 1 else values[0])


def _plan(reader, cfg) -> dict[str, dict]:
    """Slot path -> its parts {part key: (tensor, transpose)}; nothing is read. ValueError on unknown tensors."""
    plan: dict[str, dict] = {}
    for tensor in reader.tensors:
        if tensor.name in _GLOBAL:
            slot, transpose = _GLOBAL[tensor.name]
            plan.setdefault(slot, {})[0] = (tensor, transpose)
            continue
        if not tensor.name.startswith("blk."):
            continue  # rope_freqs and other derived tensors
        _, layer, rest = tensor.name.split(".", 2)
        if rest not in _LAYER:
            raise ValueError(f"deepseek2 GGUF: unexpected tensor {tensor.name}")
        if int(layer) >= cfg.num_layers:
            continue  # multi-token-prediction layers
        slot, part, transpose = _LAYER[rest]
        plan.setdefault(f"layers.{int(layer)}.{slot}", {})[part] = (tensor, transpose)
    return plan


class GGUFSlots(Mapping):
    """Slot path -> float32 value, dequantised (and its parts joined) from the memory-mapped file when indexed."""

    def __init__(self, loaders: dict[str, Callable[[], np.ndarray]], progress=None):
        self.loaders, self.progress, self.reads = loaders, progress, 0

    def __getitem__(self, slot: str) -> np.ndarray:
        value = self.loaders[slot]()
        self.reads += 1
        if self.progress is not None:
            self.progress(min(self.reads, len(self.loaders)), len(self.loaders), slot)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.loaders)

    def __len__(self) -> int:
        return len(self.loaders)


def lazy_slots(reader, cfg, progress=None) -> GGUFSlots:
    """The DeepseekModel slots of a deepseek2 file, read on demand (`build_deepseek` checks names and shapes)."""
    loaders = {slot: functools.partial(_join, parts) for slot, parts in _plan(reader, cfg).items()}
    for i in range(cfg.num_layers):
        bias = f"layers.{i}.mlp.router_bias"
        if cfg.routing == "noaux_tc" and cfg.is_moe_layer(i) and bias not in loaders:
            loaders[bias] = functools.partial(np.zeros, (cfg.n_routed_experts,), np.float32)
    return GGUFSlots(loaders, progress)


def check_slots(slots: Mapping[str, np.ndarray], cfg) -> None:
    """ValueError naming missing or unplaced slots of `cfg`'s model (reads no data)."""
    from flax import nnx

    from model.deepseek import DeepseekModel, param_slots

    want = set(param_slots(nnx.eval_shape(lambda: DeepseekModel(cfg, rngs=None))))
    missing, extra = sorted(want - set(slots)), sorted(set(slots) - want)
    if missing or extra:
        raise ValueError(f"deepseek2 GGUF does not match its config: missing {missing[:5]}, unplaced {extra[:5]}")
