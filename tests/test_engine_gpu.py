"""The paged engine on a GPU with its default (Pallas) kernels against the contiguous-cache reference, on SmolLM2.

Both paths are built through the public `LLM(...)` (so the engine's constructor may change underneath): the engine
path is `LLM.generate`, the reference is `generate_reference` (serving/engine/reference.py: a contiguous KV cache
per row, as tests/test_engine.py uses it) and `LLM.score` (one forward without a cache). The engine runs
under stress: mixed prompt lengths with a shared chat-template prefix (prefix caching on, and a second round served
from the cache), prompts longer than the 32-token step budget (chunked prefill, mixed with decode rows), 8 decode
steps per device call, and a KV pool too small for the batch (preemption and recompute).

float32: greedy continuations must be token-identical. Matmuls run at "highest" precision: by default XLA on a GPU
computes float32 dots in TF32 (10-bit mantissa), whose rounding depends on the cuBLAS algorithm chosen for each
batch shape, and the engine and the reference batch rows differently; in true float32 the only differences are the
order of additions in the attention kernels (~1e-6 relative), far below SmolLM2's gaps between the top two logits.

bfloat16: exact identity cannot hold across kernels. The Pallas kernels and the reference round P to bf16 at
different points and sum in different orders, so logits differ by a few bf16 ulps; at a near-tie of the top two
logits greedy picks differently, and from then on the two continuations are different texts. The test bounds
that disagreement by the reference's own bf16 error instead of a hand-picked constant. Let j be the engine's token
at a step and k the reference's top token there (teacher-forced over the engine's output), and d the largest
|logit_bf16 - logit_f32| of the reference scorer at those two logits over every step. If the engine's logits e and
the reference's r are each within d of the float32 logits there (the engine's kernels being no less accurate than
the reference's XLA ops), then |e - r| <= 2d at j and k, and from e_j >= e_k: r_j >= r_k - 4d. So under the
reference the engine's token is within TOL = 4d of the top logit at every step, and a divergence from the
reference's own greedy continuation can start only at a step whose reference top-2 margin is within TOL.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import resolve_backend

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]

MAX_MODEL_LEN = 176  # the longest prompt (119 tokens) + MAX_TOKENS fits
MAX_TOKENS = 40
BUDGET = 32  # max_num_batched_tokens: every prompt longer than this is prefilled in chunks
ENGINE_OPTIONS = dict(
    max_num_seqs=8,
    max_num_batched_tokens=BUDGET,
    block_size=16,
    num_kv_blocks=12,  # 11 pages (page 0 is the null page): one max_model_len sequence fits, 8 running ones do not
    enable_prefix_caching=True,
    decode_steps=8,
    warmup=False,  # compile only the buckets this workload reaches
)

# The chat template prepends the same system turn to every chat prompt (a shared prefix of whole blocks).
CHAT_QUESTIONS = [
    "What is 2+2?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List the planets of the solar system in order from the Sun, with one fact about each of them.",
]
RAW_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "1, 2, 3, 4, 5,",
    "The following is a detailed recipe for bread. Ingredients: 500 g of flour, 350 ml of water, 10 g of salt and "
    "7 g of dried yeast. Step one:",
]


def _prompts(llm) -> list[list[int]]:
    chat = [llm.encode_prompt(q, chat=True) for q in CHAT_QUESTIONS]
    raw = [llm.encode_prompt(t) for t in RAW_TEXTS]
    prompts = chat + raw + [raw[2][:3], chat[4] + raw[4] + raw[2]]  # a 3-token prompt; one of 4+ budgets
    lengths = [len(p) for p in prompts]
    assert min(lengths) <= 5 and max(lengths) > 3 * BUDGET, lengths
    return prompts


def _make_llm(dtype: str):
    from serving.engine.llm import LLM

    return LLM(dtype=dtype, max_model_len=MAX_MODEL_LEN, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def llm_f32():
    return _make_llm("float32")


@pytest.fixture(scope="module")
def llm_bf16():
    return _make_llm("bfloat16")


def _greedy(llm, prompts) -> list[list[int]]:
    """The engine's greedy token ids per prompt."""
    return [o.token_ids for o in llm.generate(prompts, max_tokens=MAX_TOKENS, temperature=0.0)]


def _reference(llm, prompts) -> list[list[int]]:
    """The contiguous-cache reference's greedy token ids per prompt (the stop token included, like the engine)."""
    from serving.engine.reference import generate_reference

    n = len(prompts)
    out = generate_reference(
        llm.model, prompts, [dict(temperature=0.0)] * n, [MAX_TOKENS] * n, llm.config.eos_token_ids, MAX_MODEL_LEN
    )
    return [list(t) for t in out.token_ids]


def _assert_stressed(engine, prompts) -> None:
    """The workload reached every path it claims to: Pallas kernels, prefix hits, chunks, decode loops, preemption."""
    for kernel in ("ragged_paged_attention", "paged_attention"):  # the engine is built with the default backend
        assert resolve_backend(None, kernel) in ("triton", "mosaic_gpu"), kernel
    sched = engine.scheduler
    assert sched.num_preemptions > 0
    assert sched.prefix_hit_tokens > 0
    assert engine.num_decode_loops > 0
    assert max(len(p) for p in prompts) > BUDGET
    print(
        f"preemptions={sched.num_preemptions} prefix_hit_tokens={sched.prefix_hit_tokens} "
        f"decode_loops={engine.num_decode_loops} prompt_lengths={[len(p) for p in prompts]}"
    )


def test_float32_greedy_is_token_identical(llm_f32):
    prompts = _prompts(llm_f32)
    with jax.default_matmul_precision("highest"):
        ref = _reference(llm_f32, prompts)
        rounds = [_greedy(llm_f32, prompts), _greedy(llm_f32, prompts)]  # the second round hits the prefix cache
    for outs in rounds:
        for i, (o, r) in enumerate(zip(outs, ref)):
            assert o == r, f"prompt {i} ({len(prompts[i])} tokens)"
    eos = set(llm_f32.config.eos_token_ids)
    assert any(r[-1] in eos for r in ref) and any(len(r) == MAX_TOKENS and r[-1] not in eos for r in ref)
    print(f"float32: {sum(map(len, ref))} reference tokens, identical in two engine rounds")
    _assert_stressed(llm_f32.engine, prompts)


def _logits(llm, prompt, gen) -> np.ndarray:
    """Reference float32 logits [len(gen), V] of the distributions each generated token was chosen from.

    Every sequence is padded to MAX_MODEL_LEN so that the scorer compiles once per model, not once per sequence
    length; attention is causal, so the padding after the real tokens does not change their logits.
    """
    ids = prompt + gen[:-1]
    return llm.score(ids + [0] * (MAX_MODEL_LEN - len(ids)))[len(prompt) - 1 : len(ids)]


def test_bfloat16_greedy_within_reference_error(llm_bf16, llm_f32):
    prompts = _prompts(llm_bf16)
    outs = _greedy(llm_bf16, prompts)
    ref = _reference(llm_bf16, prompts)
    seqs = list(zip(prompts, outs))
    logits = [_logits(llm_bf16, p, g) for p, g in seqs]  # [len(gen), V] each
    with jax.default_matmul_precision("highest"):
        exact = [_logits(llm_f32, p, g) for p, g in seqs]
    # d: the reference's bf16 error at the two logits each step's bound uses (the picked token and the top one).
    d = 0.0
    for lg, ex, g in zip(logits, exact, outs):
        rows = np.arange(len(g))
        for cols in (np.asarray(g), np.argmax(lg, axis=-1)):
            d = max(d, float(np.max(np.abs(lg[rows, cols] - ex[rows, cols]))))
    assert 0.0 < d < 2.0, f"the bf16 reference itself is off from float32 by {d}"
    tol = 4.0 * d
    worst_gap, identical = 0.0, 0
    for i, (lg, o, r) in enumerate(zip(logits, outs, ref)):
        gen = np.asarray(o)
        top = np.max(lg, axis=-1)
        gaps = top - lg[np.arange(len(gen)), gen]
        worst_gap = max(worst_gap, float(gaps.max()))
        assert gaps.max() <= tol, f"prompt {i}: step {int(gaps.argmax())} picked a token {gaps.max():.3f} below top"
        n = min(len(gen), len(r))
        first = next((t for t in range(n) if gen[t] != r[t]), None)
        if first is None:
            assert len(gen) == len(r), f"prompt {i}: same tokens, different stop"
            identical += 1
            continue
        second = np.sort(lg[first])[-2]
        assert top[first] - second <= tol, f"prompt {i}: diverged at step {first} without a near-tie"
    print(f"bf16: d={d:.4f} tol={tol:.4f} worst gap={worst_gap:.4f} identical={identical}/{len(prompts)}")
    assert jnp.dtype(llm_bf16.dtype) == jnp.bfloat16
    _assert_stressed(llm_bf16.engine, prompts)
