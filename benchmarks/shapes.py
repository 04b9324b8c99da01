"""Named model shapes for the benchmarks: ModelConfig's presets, and the families the engine reads from Hugging
Face checkpoints, given as their published config.json (the fields that shape the model), so a benchmark at
"qwen3_8b" builds exactly what `LLM("Qwen/Qwen3-8B" directory)` would, with random weights.

    model_config("llama3_8b")     ModelConfig.preset (model/config.py)
    model_config("qwen3_8b")      checkpoints.architectures.config_from_hf(HF_CONFIGS["qwen3_8b"])
"""

from __future__ import annotations

from typing import Any

from model.config import ModelConfig

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_8b": {  # Qwen/Qwen3-8B
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "gemma2_9b": {  # google/gemma-2-9b
        "architectures": ["Gemma2ForCausalLM"],
        "vocab_size": 256000,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "attention_bias": False,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
}
NAMES = (*HF_CONFIGS, "llama3_8b", "llama3_70b", "mixtral_8x7b", "qwen_moe", "gpt_oss_20b", "smollm2_135m")


def model_config(name: str) -> ModelConfig:
    """The ModelConfig of a named shape (a ModelConfig preset, or a published HF config read as the loader does)."""
    if name in HF_CONFIGS:
        from checkpoints.architectures import config_from_hf

        return config_from_hf(HF_CONFIGS[name], name=name)
    return ModelConfig.preset(name)
