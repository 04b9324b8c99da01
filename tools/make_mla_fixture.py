"""Writes tiny random-weight DeepseekV3ForCausalLM / DeepseekV2ForCausalLM checkpoints and Hugging Face's outputs.

Run in the oracle venv (tools/oracle_requirements.txt: transformers + CPU torch), never the project's venv:

    /root/.cache/pallas-serve/oracle-venv/bin/python tools/make_mla_fixture.py [--only deepseek_v2]

tests/data/hf_tiny/<name>/ receives config.json and model.safetensors (save_pretrained, bfloat16 weights),
oracle.json (prompts, HF's greedy continuations, versions, the smallest top-1 / top-2 logit margin on the greedy
paths) and logits.npy (HF's float32 logits [T, V] over the first prompt; HF reloads the bf16 weights in float32).
The V3 model has what makes DeepSeek-V3 different: a q LoRA and the kv latent with their RMSNorms, interleaved YaRN
RoPE with mscale (positions past original_max_position_embeddings), one dense layer then MoE layers with a shared
expert, grouped routing (4 groups, 2 kept) and a non-zero e_score_correction_bias. kv_lora_rank and the rope dim
are 32 and 16, powers of two, so the Pallas kernels run on it too. The V2 model is shaped like DeepSeek-V2-Lite:
no q LoRA, softmax routing with group-limited greedy top-k and unnormalised weights, complex (pairwise) YaRN RoPE.
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
VOCAB = 128


def _prompts(first_len: int) -> list[list[int]]:
    """A scored prompt longer than the YaRN original context, one sharing its first 16 tokens, a short one."""
    first = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, first_len)]
    return [first, first[:16] + [int(t) for t in np.random.default_rng(2).integers(3, VOCAB, 7)], [5, 17, 101, 33, 120]]


V3_FIELDS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=16,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    rope_interleave=True,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.8,
    ),
)
V2_FIELDS = dict(
    {k: V3_FIELDS[k] for k in ("vocab_size", "hidden_size", "qk_rope_head_dim", "kv_lora_rank", "rms_norm_eps")},
    intermediate_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=2,
    n_routed_experts=4,
    routed_scaling_factor=1.5,
    q_lora_rank=None,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=2,
    topk_group=1,
    topk_method="group_limited_greedy",
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=False,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
)
# name -> (config class, model class, fields, length of the scored prompt)
FIXTURES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", V3_FIELDS, 70),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", V2_FIELDS, 24),
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale weights: linear / expert [.., out, in] N(0, 1/in), embeddings N(0, 1), norms 1 + N(0, 0.1),
    the router's correction bias N(0, 0.05) (the scale of sigmoid score differences)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name or "rotary" in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "e_score_correction_bias" in name:
                p.copy_(0.05 * noise)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                writes_residual = any(k in name for k in ("o_proj", "down_proj"))
                p.copy_(noise * p.shape[-1] ** -0.5 * (3.0 if writes_residual else 1.0))


def _greedy_with_margin(model, prompt: list[int]) -> tuple[list[int], float]:
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_STEPS, do_sample=False, pad_token_id=0)
    full = out[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0].float()
    steps = logits[len(prompt) - 1 : -1]
    top2 = torch.topk(steps, 2, dim=-1).values
    if steps.argmax(-1).tolist() != full[len(prompt) :]:
        raise RuntimeError("HF's cached greedy path differs from the argmax of its full forward")
    return full[len(prompt) :], float((top2[:, 0] - top2[:, 1]).min())


def make(name: str) -> None:
    cfg_name, cls_name, fields, first_len = FIXTURES[name]
    cls, out, prompts = getattr(transformers, cls_name), os.path.join(OUT, name), _prompts(first_len)
    for seed in range(20):
        torch.manual_seed(seed)
        model = cls(getattr(transformers, cfg_name)(**fields)).eval()
        _redraw(model, seed)
        shutil.rmtree(out, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(out)
        if os.path.exists(os.path.join(out, "generation_config.json")):
            os.remove(os.path.join(out, "generation_config.json"))
        model = cls.from_pretrained(out, dtype=torch.float32).eval()
        greedy, margins = zip(*(_greedy_with_margin(model, p) for p in prompts))
        if min(margins) >= MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"no seed gave a greedy margin >= {MIN_MARGIN}")
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0].float().numpy()
    np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
    oracle = dict(
        architecture=cls_name,
        transformers=transformers.__version__,
        torch=torch.__version__,
        seed=seed,
        prompts=prompts,
        greedy=[list(g) for g in greedy],
        min_margin=min(margins),
    )
    with open(os.path.join(out, "oracle.json"), "w") as f:
        json.dump(oracle, f, indent=1)
    size = sum(os.path.getsize(os.path.join(out, fn)) for fn in os.listdir(out))
    print(f"{name}: seed {seed}, min margin {min(margins):.3f}, {size / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(FIXTURES), help="comma-separated fixture names")
    for name in parser.parse_args().only.split(","):
        make(name)


if __name__ == "__main__":
    main()
