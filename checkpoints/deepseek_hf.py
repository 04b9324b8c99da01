"""Hugging Face DeepseekV2ForCausalLM / DeepseekV3ForCausalLM safetensors directories -> model/deepseek.py's model.

Every tensor is read with safetensors' numpy API (no torch), transposed from HF's [out, in] to [in, out], and
written once into its slot; the fused slots are assembled from their parts:

    self_attn.{q_a_proj | q_proj}.weight, self_attn.kv_a_proj_with_mqa.weight  -> attn.w_a   [D, q_a + R + Dr]
    self_attn.q_a_layernorm / kv_a_layernorm, q_b_proj, kv_b_proj, o_proj       -> attn.q_a_norm, kv_a_norm,
                                                                                   w_q_b, w_kv_b, w_o
    mlp.{gate,up,down}_proj (dense layers)                                      -> mlp.w_gate_up [D, 2F], w_down
    mlp.gate.weight [E, D], mlp.gate.e_score_correction_bias [E] (V3)           -> mlp.w_router [D, E], router_bias
    mlp.experts.e.{gate,up,down}_proj.weight  (or transformers-5's stacked       -> mlp.w_gate_up [E, D, 2F],
        mlp.experts.gate_up_proj [E, 2F, D] and mlp.experts.down_proj [E, D, F])    mlp.w_down [E, F, D]
    mlp.shared_experts.{gate,up,down}_proj                                      -> mlp.shared.*

Layers at or past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer) are skipped. `lazy_deepseek`
only plans the reads; `build_deepseek` reads one slot at a time into an abstract model (checkpoints/loader.py
and `LLM(path)` go through both).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from checkpoints.architectures import MLA_ARCHITECTURES
from model.deepseek import DeepseekConfig, DeepseekModel, param_slots

DEEPSEEK_ARCHITECTURES = tuple(MLA_ARCHITECTURES)
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# HF per-layer suffix -> (slot path under the layer, part key, transpose). Parts of one slot are joined by `_join`.
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", None, False),
    "post_attention_layernorm.weight": ("mlp_norm.weight", None, False),
    "self_attn.q_a_proj.weight": ("attn.w_a", 0, True),
    "self_attn.q_proj.weight": ("attn.w_a", 0, True),
    "self_attn.kv_a_proj_with_mqa.weight": ("attn.w_a", 1, True),
    "self_attn.q_a_layernorm.weight": ("attn.q_a_norm.weight", None, False),
    "self_attn.q_b_proj.weight": ("attn.w_q_b", None, True),
    "self_attn.kv_a_layernorm.weight": ("attn.kv_a_norm.weight", None, False),
    "self_attn.kv_b_proj.weight": ("attn.w_kv_b", None, True),
    "self_attn.o_proj.weight": ("attn.w_o", None, True),
    "mlp.gate_proj.weight": ("mlp.w_gate_up", 0, True),
    "mlp.up_proj.weight": ("mlp.w_gate_up", 1, True),
    "mlp.down_proj.weight": ("mlp.w_down", None, True),
    "mlp.gate.weight": ("mlp.w_router", None, True),
    "mlp.gate.e_score_correction_bias": ("mlp.router_bias", None, False),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared.w_gate_up", 0, True),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared.w_gate_up", 1, True),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared.w_down", None, True),
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("embed.weight", False),
    "model.norm.weight": ("final_norm.weight", False),
    "lm_head.weight": ("lm_head", True),
}


def _weight_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index when there is one."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    out = {}
    for fn in sorted(x for x in os.listdir(path) if x.endswith(".safetensors")):
        with safe_open(os.path.join(path, fn), framework="numpy") as f:
            out.update({k: os.path.join(path, fn) for k in f.keys()})
    if not out:
        raise ValueError(f"{path}: no .safetensors files")
    return out


def _read(fn: str, name: str, transpose: bool) -> np.ndarray:
    with safe_open(fn, framework="numpy") as f:
        x = np.asarray(f.get_tensor(name), np.float32)
    return np.swapaxes(x, -1, -2) if transpose else x


def _join(parts: dict) -> np.ndarray:
    """Parts of a fused slot, each read now: {0: a, 1: b} -> [a | b] along the columns; per-expert parts
    {(e, p): ...} -> stacked [E, ...]."""
    if all(isinstance(k, int) for k in parts):
        values = [_read(*parts[k]) for k in sorted(parts)]
        return np.concatenate(values, axis=-1) if len(values) > 1 else values[0]
    experts = sorted({e for e, _ in parts})
    return np.stack([_join({p: parts[(e, p)] for ee, p in parts if ee == e}) for e in experts])


def _plan(cfg: DeepseekConfig, files: dict[str, str]) -> dict[str, dict]:
    """Slot path ("layers.3.attn.w_a", "embed.weight", ...) -> its parts {part key: (file, tensor, transpose)};
    nothing is read."""
    parts: dict[str, dict] = defaultdict(dict)
    for name, fn in files.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name in _GLOBAL_TENSORS:
            slot, transpose = _GLOBAL_TENSORS[name]
            parts[slot][0] = (fn, name, transpose)
            continue
        m = _LAYER_RE.fullmatch(name)
        if m is None:
            raise ValueError(f"{cfg.name}: unexpected tensor {name!r}")
        layer, suffix = int(m.group(1)), m.group(2)
        if layer >= cfg.num_layers:
            continue  # multi-token-prediction layers
        prefix = f"layers.{layer}."
        if (e := _EXPERT_RE.fullmatch(suffix)) is not None:
            proj = e.group(2)
            slot = "mlp.w_down" if proj == "down_proj" else "mlp.w_gate_up"
            parts[prefix + slot][(int(e.group(1)), int(proj == "up_proj"))] = (fn, name, True)
        elif suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            slot = "mlp.w_gate_up" if suffix.endswith("gate_up_proj") else "mlp.w_down"
            parts[prefix + slot][0] = (fn, name, True)
        elif suffix in _LAYER_TENSORS:
            slot, part, transpose = _LAYER_TENSORS[suffix]
            parts[prefix + slot][0 if part is None else part] = (fn, name, transpose)
        else:
            raise ValueError(f"{cfg.name}: unexpected tensor {name!r}")
    return dict(parts)


class LazySlots(Mapping):
    """Slot path -> float32 value, read (and its parts joined) from the safetensors files when indexed."""

    def __init__(self, plan: dict[str, dict]):
        self.plan = plan

    def __getitem__(self, slot: str) -> np.ndarray:
        return _join(self.plan[slot])

    def __iter__(self):
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


def is_deepseek_dir(path: str) -> bool:
    """Whether `path` is an HF checkpoint directory of a DeepseekV2ForCausalLM / DeepseekV3ForCausalLM."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return False
    with open(config_path) as f:
        hf = json.load(f)
    return bool(set(hf.get("architectures") or []) & set(DEEPSEEK_ARCHITECTURES))


def lazy_deepseek(path: str) -> tuple[DeepseekConfig, LazySlots]:
    """(config, slot path -> value read on demand) of a DeepSeek-V2 / V3 checkpoint directory; the tensor names
    are checked here, nothing is read.

    Raises:
        ValueError: no config.json, an unsupported config, no safetensors files, or an unknown tensor.
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path}: no config.json")
    with open(config_path) as f:
        hf = json.load(f)
    cfg = DeepseekConfig.from_hf(hf, name=os.path.basename(os.path.normpath(path)))
    return cfg, LazySlots(_plan(cfg, _weight_files(path)))


def build_deepseek(cfg: DeepseekConfig, slots: Mapping[str, np.ndarray], dtype=jnp.float32) -> DeepseekModel:
    """A DeepseekModel of `dtype` whose every parameter is written once from `slots` (slot path -> value, e.g.
    `lazy_deepseek`'s): the module is created abstractly, so one tensor (one layer's experts) is in host memory
    at a time.

    Raises:
        ValueError: missing, misshapen or unplaced tensors.
    """
    model = nnx.eval_shape(lambda: DeepseekModel(cfg, dtype=dtype, rngs=None))
    params = param_slots(model)
    missing = sorted(set(params) - set(slots))
    if missing:
        raise ValueError(f"{cfg.name}: checkpoint lacks the tensor(s) of {missing[:5]}")
    extra = sorted(set(slots) - set(params))
    if extra:
        raise ValueError(f"{cfg.name}: tensors with no place in the model: {extra[:5]}")
    for slot, param in params.items():
        spec = param.get_value()
        value = slots[slot]
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(f"{cfg.name}: {slot} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
        param.set_value(jnp.asarray(np.asarray(value).astype(spec.dtype, copy=False)))
    return model


def load_hf_deepseek(path: str, *, dtype=jnp.float32) -> tuple[DeepseekConfig, DeepseekModel]:
    """Reads a DeepseekV2ForCausalLM / DeepseekV3ForCausalLM checkpoint directory into a DeepseekModel of `dtype`.

    Raises:
        ValueError: missing files, an unsupported config, unknown, missing or misshapen tensors.
    """
    cfg, slots = lazy_deepseek(path)
    return cfg, build_deepseek(cfg, slots, dtype)
