"""Medusa draft heads: cheap predictors of the tokens after the next one, read off the target's last hidden state.

    h_bd  (the target's final-normed hidden state at the last position: the target's own head turns it into the
           next token t+1)
      head i:   z_i = h + SiLU(h @ W_i + b_i)                 [B, H, D]   a residual block per head
                logits_i = target.head(z_i)                   [B, H, V]   the target's own (tied or not) LM head
      head i predicts the token at offset i + 2 (i + 1 beyond the next token)

The LM head is the target's, frozen and shared (no copied [D, V] matrix per head), so a head is D^2 + D weights:
0.33 M for SmolLM2's D = 576 (1.3 MB in float32). W starts at zero (Medusa's initialisation): every head then
predicts what the target predicts for the next token, the best guess before any training.

Training (serving/train_heads.py) is self-distillation: the target's own continuations, and as soft labels the
target's next-token distributions at the later positions (head i at position p learns the target's distribution at
p + i + 1). The checkpoint is an Orbax PyTree checkpoint of {"w", "b"} plus heads.json (HeadsConfig and
training notes); `load_heads` refuses a missing or mismatched one with a ValueError naming the path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

CONFIG_FILE = "heads.json"
STATE_DIR = "heads"


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of heads: `num_heads` residual blocks of width `hidden_size` over a `vocab_size` target."""

    num_heads: int
    hidden_size: int
    vocab_size: int

    def __post_init__(self):
        for name in ("num_heads", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class MedusaHeads(nnx.Module):
    """The heads (module docstring). `init_scale` > 0 draws W ~ N(0, init_scale^2 / D) instead of zeros (tests)."""

    def __init__(self, cfg: HeadsConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, init_scale: float = 0.0):
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.hidden_size
        w = jnp.zeros((h, d, d), dtype)
        if init_scale:
            if rngs is None:
                raise ValueError("init_scale > 0 needs rngs")
            w = (init_scale * d**-0.5 * jax.random.normal(rngs.params(), (h, d, d))).astype(dtype)
        self.w = nnx.Param(w)  # [H, D, D]
        self.b = nnx.Param(jnp.zeros((h, d), dtype))  # [H, D]

    def __call__(self, h_xd: jax.Array, num_heads: int | None = None) -> jax.Array:
        """Hidden states [..., D] -> per-head states [..., H, D] (the input of the target's LM head); only the first
        `num_heads` heads when given."""
        w, b = self.w[...][:num_heads], self.b[...][:num_heads]
        z = jnp.einsum("...d,hde->...he", h_xd.astype(w.dtype), w) + b
        return h_xd[..., None, :].astype(w.dtype) + jax.nn.silu(z)


def head_logits(heads: MedusaHeads, target, h_bd: jax.Array, num_heads: int | None = None) -> jax.Array:
    """Logits [B, H, V] float32 of every head (or the first `num_heads`), through the target's LM head (`target` a
    model/transformer.py Transformer: its `head`)."""
    z_bhd = heads(h_bd, num_heads)
    return target.head(z_bhd.astype(target.dtype))


def save_heads(out_dir: str, heads: MedusaHeads, notes: dict[str, Any] | None = None) -> str:
    """Writes the Orbax checkpoint and heads.json under `out_dir` (created; an existing checkpoint is replaced)."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    state = {"w": np.asarray(heads.w[...], np.float32), "b": np.asarray(heads.b[...], np.float32)}
    with ocp.PyTreeCheckpointer() as ckpt:
        ckpt.save(os.path.join(out_dir, STATE_DIR), state, force=True)
    with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump({**dataclasses.asdict(heads.cfg), "notes": notes or {}}, f, indent=1)
    return out_dir


def load_heads(path: str, dtype=jnp.float32) -> tuple[MedusaHeads, dict[str, Any]]:
    """(heads, notes) from a directory written by `save_heads`.

    Raises:
      ValueError: `path` is not such a directory, or its arrays do not match heads.json.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    cfg_path, state_path = os.path.join(path, CONFIG_FILE), os.path.join(path, STATE_DIR)
    if not os.path.isfile(cfg_path) or not os.path.isdir(state_path):
        raise ValueError(
            f"speculative_model {path!r} is not a heads checkpoint (no {CONFIG_FILE} and {STATE_DIR}/; write one "
            "with python -m serving.train_heads)"
        )
    with open(cfg_path, encoding="utf-8") as f:
        meta = json.load(f)
    notes = meta.pop("notes", {})
    cfg = HeadsConfig(**meta)
    with ocp.PyTreeCheckpointer() as ckpt:
        state = ckpt.restore(state_path)
    h, d = cfg.num_heads, cfg.hidden_size
    if tuple(np.shape(state.get("w"))) != (h, d, d) or tuple(np.shape(state.get("b"))) != (h, d):
        raise ValueError(f"speculative_model {path!r}: arrays do not match {CONFIG_FILE} ({cfg})")
    heads = nnx.eval_shape(lambda: MedusaHeads(cfg, dtype=dtype))
    heads.w.set_value(jnp.asarray(state["w"], dtype))
    heads.b.set_value(jnp.asarray(state["b"], dtype))
    return heads, notes
