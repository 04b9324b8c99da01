"""The `quantization` option on the newer architectures, through the public API: `LLM(path, quantization=...)` over
the tiny Qwen3, Qwen3-MoE and Gemma 2 checkpoints of tests/data/hf_tiny quantises every attention and dense MLP
projection (and Qwen3-MoE's routed experts, weight-only; its router stays float: tests/test_moe_quant.py covers
the experts) and the served logits stay within a norm-relative bound of transformers' float32 logits."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from model.quant import QuantizedArray
from serving.engine.llm import LLM
from tests.hf_tiny import served_copy

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny")
OPTIONS = dict(
    dtype="float32", attention_backend="xla", max_num_seqs=1, num_kv_blocks=8, block_size=16, max_model_len=64
)
# Norm-relative logit error bounds, from the rounding of unit-scale random weights (no outliers, so the error is
# the format's own): int8 per output channel, ~0.5% rms of a weight, 1.2-1.7% of these checkpoints' logits;
# int4 asymmetric in groups of 32-64 rows, ~9% rms of a weight, 24% of Gemma 2's logits. A misplaced scale or a
# transposed weight is off by the logits' own size (~100%).
BOUNDS = {"int8": 3e-2, "int4_rtn": 0.35}
CASES = [("qwen3", "int8"), ("qwen3_moe", "int8"), ("gemma2", "int8"), ("gemma2", "int4_rtn")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each tiny checkpoint with a tokenizer beside it (a word-level vocabulary of its 256 ids: the fixtures are
    token-id only, and `LLM(path)` serves a model with its tokenizer)."""
    return {name: served_copy(name, tmp_path_factory.mktemp(name)) for name in ("qwen3", "qwen3_moe", "gemma2")}


@pytest.mark.parametrize("name,method", CASES)
def test_quantized_logits_stay_close(checkpoints, name, method):
    llm = LLM(checkpoints[name], quantization=method, **OPTIONS)
    layer = llm.model.layers[1]
    for w in (layer.attn.wqkv.get_value(), layer.attn.wo.get_value()):
        assert isinstance(w, QuantizedArray) and w.fmt == ("int8" if method == "int8" else "int4")
    if name == "qwen3_moe":
        assert not isinstance(layer.mlp.w_router.get_value(), QuantizedArray)
        assert isinstance(layer.mlp.w_gate_up.get_value(), QuantizedArray)
    else:
        assert isinstance(layer.mlp.w_down.get_value(), QuantizedArray)
    with open(os.path.join(DATA, name, "oracle.json")) as f:
        prompt = json.load(f)["prompts"][0]
    want = np.load(os.path.join(DATA, name, "logits.npy"))
    got = llm.score(prompt)
    assert got.shape == want.shape
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert 1e-4 < rel < BOUNDS[method], f"{name} {method}: logits {rel:.4f} off HF's float32 (norm-relative)"
