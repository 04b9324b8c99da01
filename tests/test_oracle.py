"""The model against the external oracle: HF transformers on the same GGUF (tools/make_oracle.py).

Our tokenizer must give the fixture's ids, our float32 logits must match within 1e-3 (max abs), and the 32-token
greedy continuation must be identical, on prose, code, a ChatML chat prompt and a 700+ token prompt.
"""

import json
import os

import numpy as np
import pytest

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def fixture():
    with open(os.path.join(DATA, "oracle_smollm2.json"), encoding="utf-8") as f:
        meta = json.load(f)
    return meta, np.load(os.path.join(DATA, "oracle_smollm2.npz"))


@pytest.fixture(scope="module")
def llm():
    from serving import LLM

    # One prefill bucket holds all four prompts (932 tokens): few CPU compilations.
    return LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=1024)


def test_fixture_covers_required_prompts(fixture):
    meta, arrays = fixture
    names = {p["name"] for p in meta["prompts"]}
    assert {"prose", "code", "chat", "long"} <= names
    assert max(len(p["ids"]) for p in meta["prompts"]) >= 500
    assert meta["dtype"] == "float32" and not meta["tokenizer"]["hf_prepends_bos"]


def test_tokenizer_ids_match(fixture, llm):
    meta, arrays = fixture
    for p in meta["prompts"]:
        assert llm.tokenizer.encode(p["text"]) == p["ids"], p["name"]
        np.testing.assert_array_equal(arrays[f"{p['name']}.ids"], p["ids"])
    for case in meta["tokenizer_cases"]:
        assert llm.tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert llm.tokenizer.decode(case["ids"], skip_special_tokens=False) == case["decoded"]


def test_chat_template_renders_like_hf(fixture, llm):
    meta, _ = fixture
    chat = next(p for p in meta["prompts"] if p["name"] == "chat")
    assert llm.tokenizer.chat_template == meta["chat_template"]
    assert llm.tokenizer.apply_chat_template(meta["chat_messages"], add_generation_prompt=True) == chat["text"]


def test_logits_match_within_1e3(fixture, llm):
    meta, arrays = fixture
    for p in meta["prompts"]:
        name = p["name"]
        logits = llm.score(p["ids"])
        assert logits.dtype == np.float32 and logits.shape == (len(p["ids"]), llm.config.vocab_size)
        positions = arrays[f"{name}.positions"]
        err = np.max(np.abs(logits[positions] - arrays[f"{name}.logits"]))
        assert err < 1e-3, f"{name}: max abs logit error {err}"
        # Every position: the oracle's top-20 logits and log-partition.
        top_ids, top_logits = arrays[f"{name}.topk_ids"], arrays[f"{name}.topk_logits"]
        ours = np.take_along_axis(logits, top_ids, axis=1)
        assert np.max(np.abs(ours - top_logits)) < 1e-3, name
        lse = np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) + logits.max(1)
        assert np.max(np.abs(lse - arrays[f"{name}.logsumexp"])) < 1e-3, name


@pytest.mark.parametrize("path", ["contiguous", "paged_engine"])
def test_greedy_continuations_identical(fixture, llm, path):
    meta, arrays = fixture
    prompts = [p["ids"] for p in meta["prompts"]]
    if path == "contiguous":  # the reference path, called directly (LLM.generate is the paged engine only)
        from serving.engine.reference import generate_reference

        rows = [dict(temperature=0.0)] * len(prompts)
        got = generate_reference(llm.model, prompts, rows, [32] * len(prompts), (), llm.max_model_len).token_ids
    else:
        got = [o.token_ids for o in llm.generate(prompts, max_tokens=32, temperature=0.0, ignore_eos=True)]
    for p, ids in zip(meta["prompts"], got):
        expected = arrays[f"{p['name']}.greedy_ids"].tolist()
        assert ids == expected == p["greedy_ids"], p["name"]
