"""Model configuration: a frozen dataclass with presets, no I/O.

Loaders (checkpoints/gguf.py, checkpoints/hf.py) build a ModelConfig from file metadata; binaries build one from
flags or presets. Everything else only reads it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (rope_type="llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
        name: preset or checkpoint name, for messages only.
        vocab_size: number of token embeddings V.
        hidden_size: model width D.
        intermediate_size: gated-MLP width F.
        num_layers: number of decoder blocks L.
        num_heads: query heads Hq.
        num_kv_heads: key/value heads Hkv (Hq must be a multiple of Hkv).
        head_dim: per-head width hd.
        rope_theta: RoPE base frequency.
        rope_scaling: optional Llama-3 frequency scaling.
        rms_norm_eps: RMSNorm epsilon.
        max_position_embeddings: longest context the model supports.
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        bos_token_id: beginning-of-sequence token, or None.
        eos_token_ids: tokens that end generation.
    """

    name: str = "custom"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f = self.hidden_size, self.intermediate_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data: dict[str, Any] = json.loads(text)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)

    # Presets -----------------------------------------------------------------------------------------------------

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        return cls(
            name="smollm2_135m",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_ids=(2,),
        )

    @classmethod
    def llama3_8b(cls) -> ModelConfig:
        return cls(
            name="llama3_8b",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(),
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            bos_token_id=128000,
            eos_token_ids=(128001, 128009),
        )

    @classmethod
    def llama3_70b(cls) -> ModelConfig:
        return cls.llama3_8b().replace(
            name="llama3_70b", hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64
        )

    @classmethod
    def tiny(cls, **changes) -> ModelConfig:
        """A few-layer model for tests: GQA 4/2, odd sizes so shape bugs show."""
        base = cls(
            name="tiny",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_ids=(2,),
        )
        return base.replace(**changes)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        presets = {
            "smollm2_135m": cls.smollm2_135m,
            "llama3_8b": cls.llama3_8b,
            "llama3_70b": cls.llama3_70b,
            "tiny": cls.tiny,
        }
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()
