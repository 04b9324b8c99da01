"""Each registered architecture against Hugging Face transformers, on tiny random-weight checkpoints.

tests/data/hf_tiny/<name>/ holds a checkpoint written by transformers (tools/make_hf_fixtures.py) with HF's
float32 logits over a prompt and HF's greedy continuations of three prompts. Here the checkpoint is loaded by
checkpoints/hf.py and
  - the float32 logits over the prompt (one forward, contiguous path) match HF's within 1e-4;
  - greedy continuations through the paged engine (Pallas kernels in interpret mode) are HF's, token for token,
    with chunked prefill (8-token steps), preemption (a pool too small for all three) and prefix caching on (the
    second prompt shares the first's 16-token prefix). Each engine compiles for ~30-45 s on a 2-core CPU, so this
    runs for the architectures whose blocks differ from Llama's; Llama 3.2 and Mistral use the Llama block the
    engine tests already run (tests/test_engine.py, and Mistral windows in tests/test_gemma3.py) and are checked
    against HF by their logits here.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import hf
from checkpoints.architectures import ARCHITECTURES
from serving.engine.llm import LLM

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny")
NAMES = sorted(n for n in os.listdir(DATA) if os.path.isfile(os.path.join(DATA, n, "oracle.json")))
NAMES = [n for n in NAMES if json.load(open(os.path.join(DATA, n, "oracle.json")))["architecture"] in ARCHITECTURES]
LLAMA_BLOCK = ("llama32", "mistral")
ENGINE = dict(
    dtype="float32",
    max_num_seqs=2,
    max_num_batched_tokens=8,
    num_kv_blocks=13,
    block_size=4,
    max_model_len=48,
    attention_backend="interpret",
    decode_steps=1,
    warmup=False,
    compilation_cache_dir="",
    enable_prefix_caching=True,
)


def _oracle(name):
    with open(os.path.join(DATA, name, "oracle.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    name = request.param
    # float32 from the stored bfloat16, as HF computed; no tokenizer: the prompts are token ids.
    config, params = hf.load_hf(os.path.join(DATA, name), dtype=np.float32)
    return name, _oracle(name), LLM.from_params(config, params, **ENGINE)


def test_every_registered_architecture_has_a_fixture():
    archs = {_oracle(n)["architecture"] for n in NAMES}
    assert archs >= {
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "GptOssForCausalLM",
    }


def test_logits_match_hf(model):
    from serving.engine.llm import _score

    name, oracle, llm = model
    want = np.load(os.path.join(DATA, name, "logits.npy"))
    got = np.asarray(_score(llm.model, jnp.asarray([oracle["prompts"][0]], jnp.int32))[0])
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err < 1e-4, f"{name}: max abs logit error {err} (logits up to {np.abs(want).max():.1f})"


def test_greedy_through_the_engine_matches_hf(model):
    name, oracle, llm = model
    if name in LLAMA_BLOCK:
        pytest.skip("the Llama block: the engine tests run it; its logits are checked against HF above")
    prompts, want = oracle["prompts"], oracle["greedy"]
    steps = len(want[0])
    sched = llm.engine.scheduler
    hits = sched.prefix_hit_tokens
    got = [o.token_ids for o in llm.generate(prompts, max_tokens=steps, temperature=0.0, ignore_eos=True)]
    assert got == want, name
    assert sched.num_preemptions > 0, "the pool was meant to be too small for all three prompts"
    assert sched.prefix_hit_tokens > hits, "the second prompt (or a resumed one) was meant to hit the cache"


def test_config_fields():
    qwen3 = hf.config_from_hf(json.load(open(os.path.join(DATA, "qwen3", "config.json"))))
    assert qwen3.has_qk_norm and not qwen3.is_gemma and qwen3.sliding_window is None
    moe = hf.config_from_hf(json.load(open(os.path.join(DATA, "qwen3_moe", "config.json"))))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (4, 2, True)
    assert moe.shared_expert_intermediate_size == 0 and moe.has_qk_norm
    gemma3 = hf.config_from_hf(json.load(open(os.path.join(DATA, "gemma3", "config.json"))))
    assert gemma3.layer_windows == (8, 8, None) and gemma3.arch == "gemma3"
    assert (gemma3.layer_rope_theta(0), gemma3.layer_rope_theta(2)) == (1e4, 1e6)
    gemma2 = hf.config_from_hf(json.load(open(os.path.join(DATA, "gemma2", "config.json"))))
    assert gemma2.arch == "gemma2" and gemma2.is_gemma and not gemma2.has_qk_norm and gemma2.layer_windows == (8, None)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.query_pre_attn_scalar) == (8.0, 20.0, 24.0)
    phi3 = hf.config_from_hf(json.load(open(os.path.join(DATA, "phi3", "config.json"))))
    assert phi3.long_rope and phi3.rope_scaling.original_max_position_embeddings == 64
    assert phi3.layer_windows == (16, 16)
    assert abs(phi3.rope_scaling.attention_factor - (1 + np.log(4) / np.log(64)) ** 0.5) < 1e-12
    oss = hf.config_from_hf(json.load(open(os.path.join(DATA, "gpt_oss", "config.json"))))
    assert oss.layer_windows == (8, None) and oss.attention_sinks and oss.attention_out_bias and oss.attention_bias
    assert (oss.num_experts, oss.num_experts_per_tok, oss.moe_routing, oss.moe_bias) == (4, 2, "topk_softmax", True)
    assert (oss.swiglu_limit, oss.swiglu_alpha, oss.rope_scaling.rope_type) == (1.5, 1.702, "yarn")
    assert abs(oss.rope_scaling.attention_factor - (0.1 * np.log(32) + 1)) < 1e-12 and not oss.rope_scaling.truncate
