"""Writes tiny random-weight HF checkpoints and Hugging Face's own outputs for them (tests/data/hf_tiny/).

Run in the oracle venv (tools/oracle_requirements.txt: transformers + CPU torch), never the project's venv:

    /root/.cache/pallas-serve/oracle-venv/bin/python tools/make_hf_fixtures.py [--only qwen3,gemma2]

Per architecture, tests/data/hf_tiny/<name>/ receives:
  config.json, model.safetensors   the checkpoint as `save_pretrained` writes it, weights in bfloat16 (small);
  oracle.json                      prompts, HF's greedy continuations, the transformers / torch versions, the
                                   smallest top-1 / top-2 logit margin along the greedy paths;
  logits.npy                       HF's float32 logits [T, V] over the first prompt.
HF computes in float32 from the bfloat16 weights as stored (the checkpoint is reloaded with dtype=float32), which
is exactly what the engine does with them. Weights are redrawn at unit scale (linear N(0, 1/fan_in), norms near
their identity), so logits are well separated and a greedy continuation does not hinge on rounding; a seed whose
greedy path has a top-1 / top-2 margin below MIN_MARGIN is skipped for the next.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hf_tiny")
MIN_MARGIN = 1e-2
GREEDY_STEPS = 12
VOCAB = 256
# The first prompt is scored (logits.npy); the second shares its first 16 tokens (a prefix-cache hit in the
# engine); the third is short. Lengths pass the tiny sliding windows (8) below.
PROMPTS = [
    [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, 26)],
]
PROMPTS.append(PROMPTS[0][:16] + [int(t) for t in np.random.default_rng(2).integers(3, VOCAB, 7)])
PROMPTS.append([5, 17, 101, 33, 250])

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _archs() -> dict[str, tuple[type, type, dict]]:
    """Fixture name -> (config class, model class, config fields)."""
    t = transformers
    return {
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(rope_theta=1e6)),
        "qwen3_moe": (
            t.Qwen3MoeConfig,
            t.Qwen3MoeForCausalLM,
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        ),
        "gemma2": (
            t.Gemma2Config,
            t.Gemma2ForCausalLM,
            dict(
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=8,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=8.0,
                final_logit_softcapping=20.0,
                tie_word_embeddings=True,
            ),
        ),
        "gemma3": (
            t.Gemma3TextConfig,
            t.Gemma3ForCausalLM,
            dict(
                hidden_activation="gelu_pytorch_tanh",
                num_hidden_layers=3,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                sliding_window=8,
                query_pre_attn_scalar=24,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                },
                tie_word_embeddings=True,
            ),
        ),
        "phi3": (
            t.Phi3Config,
            t.Phi3ForCausalLM,
            dict(
                sliding_window=16,
                original_max_position_embeddings=64,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                    "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.0, 9.0],
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        "llama32": (
            t.LlamaConfig,
            t.LlamaForCausalLM,
            dict(
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(sliding_window=8)),
        # Sliding / full layers, sinks, YaRN, 4 experts of width 32 with biases; a low SwiGLU limit so the
        # clamps bind on these unit-scale weights.
        "gpt_oss": (
            t.GptOssConfig,
            t.GptOssForCausalLM,
            dict(
                intermediate_size=32,
                max_position_embeddings=2048,  # YaRN's factor 32 over 64 original positions
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                swiglu_limit=1.5,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
    }


def _redraw(model: torch.nn.Module, seed: int, gemma: bool, tied: bool) -> None:
    """Unit-scale random weights: linear / expert [.., out, in] N(0, 1/in), embeddings N(0, 1), norm weights
    near the identity (1 + N(0, 0.1), or N(0, 0.1) under Gemma's (1 + w))."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("sinks"):  # gpt-oss: sink logits on the scores' scale, so they take a real share
                p.copy_(noise + 1.0)
            elif p.ndim == 1:  # (Gemma's post-branch norms start at 3x, so the branches outweigh the embedding)
                post = gemma and ("post_" in name or "pre_feedforward" in name)
                p.copy_(0.1 * noise + (2.0 if post else 0.0 if gemma else 1.0 if "norm" in name else 0.0))
            elif "embed_tokens" in name:  # Gemma multiplies embeddings by sqrt(D): start them at unit RMS
                p.copy_(noise * (p.shape[-1] ** -0.5 if gemma else 0.3 if tied else 1.0))
            else:  # The residual writers are scaled up so that a tied head does not just echo the last token.
                writes_residual = any(k in name for k in ("o_proj", "down_proj"))
                p.copy_(noise * p.shape[-1] ** -0.5 * (3.0 if writes_residual else 1.0))


def _greedy_with_margin(model, prompt: list[int]) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    # No end-of-sequence token: the continuation runs its full length (the engine's ignore_eos).
    model.generation_config.eos_token_id = None
    out = model.generate(ids, max_new_tokens=GREEDY_STEPS, do_sample=False, pad_token_id=0)
    full = out[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0].float()
    steps = logits[len(prompt) - 1 : -1]
    top2 = torch.topk(steps, 2, dim=-1).values
    if steps.argmax(-1).tolist() != full[len(prompt) :]:
        raise RuntimeError("HF's cached greedy path differs from the argmax of its full forward")
    return full[len(prompt) :], float((top2[:, 0] - top2[:, 1]).min())


def make(name: str, cfg_cls, model_cls, fields: dict) -> None:
    directory = os.path.join(OUT, name)
    for seed in range(20):
        torch.manual_seed(seed)
        config = cfg_cls(**{**_COMMON, **fields})
        model = model_cls(config).eval()
        _redraw(model, seed, gemma=name.startswith("gemma"), tied=config.tie_word_embeddings)
        shutil.rmtree(directory, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(directory)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(directory, extra)):
                os.remove(os.path.join(directory, extra))
        model = model_cls.from_pretrained(directory, dtype=torch.float32).eval()
        greedy, margins = [], []
        for prompt in PROMPTS:
            ids, margin = _greedy_with_margin(model, prompt)
            greedy.append(ids)
            margins.append(margin)
        if min(margins) >= MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed gave a greedy margin >= {MIN_MARGIN}")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0].float().numpy()
    np.save(os.path.join(directory, "logits.npy"), logits.astype(np.float32))
    oracle = dict(
        architecture=config.architectures[0] if config.architectures else model_cls.__name__,
        transformers=transformers.__version__,
        torch=torch.__version__,
        seed=seed,
        prompts=PROMPTS,
        greedy=greedy,
        min_margin=min(margins),
    )
    with open(os.path.join(directory, "oracle.json"), "w") as f:
        json.dump(oracle, f, indent=1)
    size = sum(os.path.getsize(os.path.join(directory, fn)) for fn in os.listdir(directory))
    print(f"{name}: seed {seed}, min margin {min(margins):.3f}, {size / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated fixture names (default: all)")
    args = parser.parse_args()
    archs = _archs()
    names = [n for n in args.only.split(",") if n] or list(archs)
    unknown = sorted(set(names) - set(archs))
    if unknown:
        raise SystemExit(f"unknown fixture(s) {unknown}; choose from {sorted(archs)}")
    torch.set_grad_enabled(False)
    transformers.utils.logging.disable_progress_bar()
    for name in names:
        make(name, *archs[name])


if __name__ == "__main__":
    main()
