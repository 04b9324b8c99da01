"""Model configuration: a frozen dataclass with presets, no I/O.

Loaders (checkpoints/gguf.py, checkpoints/hf.py) build a ModelConfig from file metadata; binaries build one from
flags or presets. Everything else only reads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

ARCHS = ("llama", "gemma2", "gemma3")
ROPE_TYPES = ("llama3", "linear", "longrope", "yarn")
MOE_ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    rope_type "llama3" (Llama 3.1+): wavelengths past original / low_freq_factor divided by `factor`, the band to
    original / high_freq_factor interpolated. "linear": every frequency divided by `factor`. "longrope" (Phi-3,
    "su" in older configs): frequency i divided by short_factor[i] at positions below
    original_max_position_embeddings and by long_factor[i] from there on, and cos / sin multiplied by
    attention_factor (folded into the attention logit scale as attention_factor ** 2, ModelConfig.attn_scale).
    "yarn" (gpt-oss): YaRN's frequencies (model/mla.py's, shared with DeepSeek) from factor,
    original_max_position_embeddings, beta_fast / beta_slow and truncate; cos / sin times attention_factor.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("longrope RoPE scaling needs short_factor and long_factor of equal, non-zero length")


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
        num_experts: routed experts E of every MoE MLP; 0 for a dense model (then the MoE fields below are 0).
        num_experts_per_tok: experts k each token is routed to (top-k of the router's softmax).
        moe_intermediate_size: gated-MLP width of one routed expert.
        shared_expert_intermediate_size: width of the always-on shared expert (Qwen-MoE), 0 for none.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1 (Mixtral: yes; Qwen1.5-MoE: no).
        sliding_window: keys a windowed layer's query at position p sees are (p - window, p]; None: full causal.
            Mistral-style configs window every layer.
        sliding_window_pattern: with a window, every `pattern`-th layer (layer i with (i + 1) % pattern == 0) is
            global (full causal) and the others windowed (Gemma 3: 6); 0 windows every layer (Mistral).
        rope_local_theta: RoPE base of the windowed layers when they differ from the global ones (Gemma 3: 10k
            local, 1M global in `rope_theta`); None: `rope_theta` everywhere.
        arch: block layout, "llama" (pre-norm, SwiGLU), "gemma2" (pre + post norms around attention and MLP,
            GELU-tanh MLP, RMSNorm weights applied as (1 + w), embeddings scaled by sqrt(D)) or "gemma3" (gemma2's
            layout plus QK-norm).
        query_pre_attn_scalar: attention logits are scaled by query_pre_attn_scalar ** -0.5; None: head_dim.
        final_logit_softcap: logits -> cap * tanh(logits / cap) when set (Gemma 2; None for Gemma 3).
        qk_norm: RMSNorm over each query / key head before RoPE (Qwen3; always on for "gemma3").
        attn_logit_softcap: attention scores -> cap * tanh(scores / cap) before the softmax (Gemma 2), or None.
        attention_sinks: a learned logit per query head joins every softmax denominator (gpt-oss).
        attention_out_bias: the output projection carries a bias (gpt-oss).
        moe_routing: "softmax_topk" (top-k of the softmax over all experts) or "topk_softmax" (softmax over the
            k largest router logits, gpt-oss); model/moe.py.
        moe_bias: the router and the routed experts carry biases (gpt-oss).
        swiglu_limit, swiglu_alpha: the experts' clamped SwiGLU (gpt-oss, model/moe.py Activation), or None.
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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sliding_window: int | None = None
    sliding_window_pattern: int = 0
    rope_local_theta: float | None = None
    arch: str = "llama"
    query_pre_attn_scalar: float | None = None
    final_logit_softcap: float | None = None
    qk_norm: bool = False
    attn_logit_softcap: float | None = None
    attention_sinks: bool = False
    attention_out_bias: bool = False
    moe_routing: str = "softmax_topk"
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None

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
        self._validate_moe()
        self._validate_window()

    def _validate_window(self):
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be None or >= 1, got {self.sliding_window}")
        for cap in ("final_logit_softcap", "attn_logit_softcap"):
            if getattr(self, cap) is not None and getattr(self, cap) <= 0:
                raise ValueError(f"ModelConfig.{cap} must be None or positive, got {getattr(self, cap)}")
        if self.moe_routing not in MOE_ROUTINGS:
            raise ValueError(f"ModelConfig.moe_routing must be one of {MOE_ROUTINGS}, got {self.moe_routing!r}")
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None) or (self.swiglu_limit or 1) <= 0:
            raise ValueError("ModelConfig.swiglu_limit and swiglu_alpha are set together, the limit positive")
        if self.sliding_window_pattern < 0:
            raise ValueError(f"ModelConfig.sliding_window_pattern must be >= 0, got {self.sliding_window_pattern}")

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of `layer` (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        pattern = self.sliding_window_pattern
        return None if pattern and (layer + 1) % pattern == 0 else self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def kv_window(self) -> int | None:
        """The window every layer has, so KV older than it is dead for all layers (None: some layer is global)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    def layer_rope_theta(self, layer: int) -> float:
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope_scaling(self, layer: int) -> RopeScaling | None:
        """RoPE scaling of `layer`: with a separate local base (Gemma 3) only the global layers are scaled."""
        local = self.rope_local_theta is not None and self.layer_window(layer) is not None
        return None if local else self.rope_scaling

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 / 3 block layout: post-branch norms, (1 + w) RMSNorm, GELU-tanh, embeddings scaled by sqrt(D)."""
        return self.arch in ("gemma2", "gemma3")

    @property
    def has_qk_norm(self) -> bool:
        return self.qk_norm or self.arch == "gemma3"

    @property
    def long_rope(self) -> bool:
        """Positions from rope_scaling.original_max_position_embeddings on use other frequencies (longrope)."""
        return self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope"

    @property
    def mlp_activation(self) -> str:
        return "gelu_tanh" if self.is_gemma else "silu"

    @property
    def norm_offset(self) -> float:
        """RMSNorm scales by (norm_offset + w): 1 for Gemma's (1 + w) convention, 0 for Llama's."""
        return 1.0 if self.is_gemma else 0.0

    @property
    def attn_scale(self) -> float:
        scaled = self.long_rope or (self.rope_scaling is not None and self.rope_scaling.rope_type == "yarn")
        rope_mscale = self.rope_scaling.attention_factor if scaled else 1.0  # on both q and k
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * rope_mscale**2

    def _validate_moe(self):
        moe = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        for field in ("num_experts", *moe):
            if getattr(self, field) < 0:
                raise ValueError(f"ModelConfig.{field} must be >= 0, got {getattr(self, field)}")
        if self.num_experts == 0:
            set_fields = [f for f in moe if getattr(self, f)]
            if set_fields:
                raise ValueError(f"ModelConfig.{set_fields[0]} is set but num_experts is 0 (a dense model)")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(
                f"ModelConfig.moe_intermediate_size must be positive for an MoE model, got {self.moe_intermediate_size}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def _mlp_params(self, experts: int) -> int:
        """MLP parameters of one layer with `experts` routed experts counted (all of them, or the k active)."""
        d = self.hidden_size
        if not self.is_moe:
            return 3 * d * self.intermediate_size
        shared = self.shared_expert_intermediate_size
        shared_params = 3 * d * shared + d if shared else 0  # + the shared expert's sigmoid gate [D, 1]
        return d * self.num_experts + experts * 3 * d * self.moe_intermediate_size + shared_params

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embedding counted once when tied); `active`: only the k routed experts a token uses."""
        d = self.hidden_size
        experts = self.num_experts_per_tok if active else self.num_experts
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        norms = (4 * d if self.is_gemma else 2 * d) + (2 * self.head_dim if self.has_qk_norm else 0)
        per_layer = attn + self._mlp_params(experts) + norms
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
            rope = data["rope_scaling"]
            factors = {k: tuple(rope.get(k, ())) for k in ("short_factor", "long_factor")}
            data["rope_scaling"] = RopeScaling(**{**rope, **factors})
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
    def gemma3_270m(cls) -> ModelConfig:
        """Gemma 3 270M: 18 layers, MQA 4/1 of width 256, window 512 on five of every six layers."""
        return cls(
            name="gemma3_270m",
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_layers=18,
            num_heads=4,
            num_kv_heads=1,
            head_dim=256,
            rope_theta=1e6,
            rope_local_theta=1e4,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_ids=(1, 106),
            sliding_window=512,
            sliding_window_pattern=6,
            arch="gemma3",
            query_pre_attn_scalar=256.0,
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
    def mixtral_8x7b(cls) -> ModelConfig:
        """Mixtral-8x7B-v0.1: 8 experts of width 14336, top-2, renormalised routing weights."""
        return cls(
            name="mixtral_8x7b",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=1e6,
            rms_norm_eps=1e-5,
            max_position_embeddings=32768,
            bos_token_id=1,
            eos_token_ids=(2,),
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=14336,
            norm_topk_prob=True,
        )

    @classmethod
    def qwen_moe(cls) -> ModelConfig:
        """Qwen1.5-MoE-A2.7B: 60 experts of width 1408, top-4 (not renormalised), a 5632-wide shared expert."""
        return cls(
            name="qwen_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5632,
            num_layers=24,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            max_position_embeddings=8192,
            attention_bias=True,
            bos_token_id=151643,
            eos_token_ids=(151643,),
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            norm_topk_prob=False,
        )

    @classmethod
    def tiny_moe(cls, **changes) -> ModelConfig:
        """`tiny` with a Qwen-MoE-style MLP: 6 experts of width 48, top-2, a 40-wide shared expert (odd sizes)."""
        moe = dict(
            name="tiny_moe",
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
        )
        return cls.tiny(**{**moe, **changes})

    @classmethod
    def gpt_oss_20b(cls) -> ModelConfig:
        """gpt-oss-20b's shape (openai/gpt-oss-20b config.json): 24 layers alternating window 128 / full, 64 query
        heads over 8 KV heads with sinks, 32 experts top-4 of width 2880 with biases, YaRN x32 over 4096."""
        yarn = RopeScaling(
            rope_type="yarn",
            factor=32.0,
            original_max_position_embeddings=4096,
            truncate=False,
            attention_factor=0.1 * math.log(32.0) + 1.0,
        )
        return cls(
            name="gpt_oss_20b",
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_layers=24,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            rope_theta=150000.0,
            rope_scaling=yarn,
            max_position_embeddings=131072,
            attention_bias=True,
            bos_token_id=199998,
            eos_token_ids=(200002, 199999, 200012),
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=2880,
            sliding_window=128,
            sliding_window_pattern=2,
            attention_sinks=True,
            attention_out_bias=True,
            moe_routing="topk_softmax",
            moe_bias=True,
            swiglu_limit=7.0,
            swiglu_alpha=1.702,
        )

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        presets = {
            "smollm2_135m": cls.smollm2_135m,
            "gemma3_270m": cls.gemma3_270m,
            "llama3_8b": cls.llama3_8b,
            "llama3_70b": cls.llama3_70b,
            "mixtral_8x7b": cls.mixtral_8x7b,
            "qwen_moe": cls.qwen_moe,
            "gpt_oss_20b": cls.gpt_oss_20b,
            "tiny": cls.tiny,
            "tiny_moe": cls.tiny_moe,
        }
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()
