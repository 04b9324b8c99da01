"""GGUF gpt-oss and deepseek2 against their HF checkpoints: the tiny fixtures of tests/data/hf_tiny written as
llama.cpp's converter writes them (tools/hf_to_gguf.py: gpt-oss's split gate / up experts, sinks and biases,
MXFP4 experts repacked into ggml blocks; deepseek2's MQA form with kv_b split into attn_k_b / attn_v_b, or the
older whole attn_kv_b) load to the parameters of the safetensors, hence to transformers' float32 logits within
1e-4; `LLM(path)` serves them (deepseek2 through model/deepseek.py's MLA decoder) with HF's greedy tokens; Q8_0
files stay close; files llama.cpp's keys cannot describe are refused with the key they lack."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from checkpoints import hf
from checkpoints.deepseek_hf import build_deepseek, lazy_deepseek
from checkpoints.gguf import load_gguf
from model.deepseek import DeepseekConfig
from model.kv import NoCache
from model.quant import QuantizedArray
from model.transformer import build_model
from serving.engine.llm import _score
from tools.hf_to_gguf import convert

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny")
# file key -> (fixture, convert options)
FILES = {
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss.Q8_0": ("gpt_oss", dict(tensor_type="Q8_0")),
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v2.legacy": ("deepseek_v2", dict(legacy_mla=True)),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3.Q8_0": ("deepseek_v3", dict(tensor_type="Q8_0")),
}
ENGINE = dict(dtype="float32", attention_backend="xla", max_num_seqs=4, num_kv_blocks=40, block_size=8)
ENGINE |= dict(max_model_len=96, max_num_batched_tokens=128, warmup=False, decode_steps=1, compilation_cache_dir="")


def _oracle(name: str) -> dict:
    with open(os.path.join(DATA, name, "oracle.json")) as f:
        return json.load(f)


def _hf_logits(name: str) -> np.ndarray:
    return np.load(os.path.join(DATA, name, "logits.npy"))


def _mla_logits(cfg, slots, name: str) -> np.ndarray:
    prompt = _oracle(name)["prompts"][0]
    t = len(prompt)
    logits, _ = build_deepseek(cfg, slots)(
        jnp.asarray([prompt]), jnp.arange(t)[None], None, NoCache(valid_len=jnp.asarray([t]))
    )
    return np.asarray(logits[0])


def _gqa_logits(config, params, name: str) -> np.ndarray:
    model = build_model(config, params, jnp.float32)
    return np.asarray(_score(model, jnp.asarray([_oracle(name)["prompts"][0]], jnp.int32))[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for key, (name, options) in FILES.items():
        path = str(tmp_path_factory.mktemp("gguf") / f"{key}.gguf")
        convert(os.path.join(DATA, name), path, byte_vocab=True, **options)
        out[key] = path
    return out


def test_gpt_oss_file_loads_the_hf_model(files):
    config, params, meta = load_gguf(files["gpt_oss"])
    want_cfg, want = hf.load_hf(os.path.join(DATA, "gpt_oss"), dtype=np.float32)
    assert meta.architecture == "gpt-oss"
    differ = {
        f.name: (getattr(config, f.name), getattr(want_cfg, f.name))
        for f in dataclasses.fields(config)
        if f.name not in ("name", "rms_norm_eps") and getattr(config, f.name) != getattr(want_cfg, f.name)
    }
    assert not differ, differ  # sinks, biases, windows on even layers, YaRN (unrounded ramp), clamp 1.5 (a key)
    assert config.rms_norm_eps == pytest.approx(want_cfg.rms_norm_eps, rel=1e-6)
    assert sorted(params) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(params[key]), want[key], err_msg=key)
    err = np.abs(_gqa_logits(config, params, "gpt_oss") - _hf_logits("gpt_oss")).max()
    assert err < 1e-4, f"gpt-oss: max abs logit error {err}"


@pytest.mark.parametrize("key", ["deepseek_v2", "deepseek_v2.legacy", "deepseek_v3"])
def test_deepseek2_file_builds_the_mla_decoder(files, key):
    name = FILES[key][0]
    cfg, slots, meta = load_gguf(files[key], lazy=True)
    want_cfg, want = lazy_deepseek(os.path.join(DATA, name))
    assert meta.architecture == "deepseek2" and isinstance(cfg, DeepseekConfig)
    mla, want_mla = cfg.mla, want_cfg.mla
    assert dataclasses.replace(cfg, name="", rms_norm_eps=1e-6, mla=want_mla) == dataclasses.replace(want_cfg, name="")
    same = dict(rms_norm_eps=1e-6, yarn=None)
    assert dataclasses.replace(mla, **same) == dataclasses.replace(want_mla, **same)
    assert mla.sm_scale == pytest.approx(want_mla.sm_scale, rel=1e-6)  # YaRN as llama.cpp keys describe it
    (inv, factor), (want_inv, want_factor) = mla.rope(), want_mla.rope()
    np.testing.assert_allclose(np.asarray(inv), np.asarray(want_inv), rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-6)
    assert sorted(slots) == sorted(want)
    for slot in want:
        np.testing.assert_array_equal(np.asarray(slots[slot]), want[slot], err_msg=slot)
    err = np.abs(_mla_logits(cfg, slots, name) - _hf_logits(name)).max()
    assert err < 1e-4, f"{key}: max abs logit error {err}"


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_llm_serves_the_file_with_hf_greedy_tokens(files, name):
    """Through the public API, as a user loads a .gguf: the byte vocabulary is the tokenizer, the prompts are ids."""
    from serving.engine.llm import LLM

    llm = LLM(files[name], **ENGINE)
    assert isinstance(llm.config, DeepseekConfig) == (name == "deepseek_v3")
    oracle = _oracle(name)
    np.testing.assert_allclose(llm.score(oracle["prompts"][0]), _hf_logits(name), atol=1e-4, rtol=0)
    got = llm.generate(oracle["prompts"], max_tokens=len(oracle["greedy"][0]), temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in got] == oracle["greedy"]


def _assert_q8_0_close(got: np.ndarray, name: str) -> None:
    """Q8_0 rounds every weight, experts and router included (~0.5% rms each), so the logits move by some percent of
    their norm, more where a token's top-k experts flip (a discrete change); the argmax stays HF's almost
    everywhere. The dense architectures' bound (tests/test_gguf_archs.py) is 3%."""
    want = _hf_logits(name)
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert 1e-3 < rel < 0.2, f"{name}: Q8_0 logits {rel:.4f} off HF's (norm-relative)"
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9, name


def test_q8_0_files_stay_close(files):
    config, qparams, _ = load_gguf(files["gpt_oss.Q8_0"], lazy=True, quantized=True)
    _, fparams, _ = load_gguf(files["gpt_oss.Q8_0"], lazy=True)
    q = qparams["layers.1.wq"]
    assert isinstance(q, QuantizedArray) and q.fmt == "int8" and q.group_size == 32
    assert not isinstance(qparams["layers.1.w_gate_up"], QuantizedArray)  # experts dequantised
    kept = _gqa_logits(config, qparams, "gpt_oss")
    np.testing.assert_allclose(kept, _gqa_logits(config, fparams, "gpt_oss"), rtol=1e-5, atol=1e-5)
    _assert_q8_0_close(kept, "gpt_oss")
    cfg, slots, _ = load_gguf(files["deepseek_v3.Q8_0"], lazy=True)
    _assert_q8_0_close(_mla_logits(cfg, slots, "deepseek_v3"), "deepseek_v3")
    with pytest.raises(ValueError, match="not supported for deepseek2"):
        load_gguf(files["deepseek_v3.Q8_0"], quantized=True)


def test_mxfp4_experts_repacked_and_dequantised(tmp_path):
    """gpt-oss as OpenAI publishes it (MXFP4 expert blocks / scales): the writer repacks them into ggml's MXFP4
    blocks without requantising, and the loader reads back exactly the values HF's loader dequantises."""
    import gguf

    src = tmp_path / "gpt_oss_mxfp4"
    src.mkdir()
    shutil.copy(os.path.join(DATA, "gpt_oss", "config.json"), src)
    rng, tensors = np.random.default_rng(0), {}
    with safe_open(os.path.join(DATA, "gpt_oss", "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            x = f.get_tensor(name).astype(np.float32)
            if name.endswith(("gate_up_proj", "down_proj")):  # [E, in, out] -> blocks [E, out, in / 32, 16]
                e, k, n = x.shape
                tensors[name + "_blocks"] = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
                tensors[name + "_scales"] = rng.integers(118, 130, (e, n, k // 32), dtype=np.uint8)
            else:
                tensors[name] = x
    save_file(tensors, str(src / "model.safetensors"))
    path = str(tmp_path / "mxfp4.gguf")
    convert(str(src), path)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    _, params, _ = load_gguf(path)
    _, want = hf.load_hf(str(src), dtype=np.float32)
    for key in ("layers.0.w_gate_up", "layers.1.w_gate_up", "layers.0.w_experts_down", "layers.1.b_gate_up"):
        np.testing.assert_array_equal(params[key], want[key], err_msg=key)


def _rewrite(src: str, dst: str, edit) -> str:
    """`src` with the same metadata and its tensors {name: array} passed through `edit`, written to `dst`."""
    import gguf

    reader = gguf.GGUFReader(src)
    out = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            out.add_key_value(key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    for name, data in edit({t.name: np.asarray(t.data) for t in reader.tensors}).items():
        out.add_tensor(name, data)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return dst


def _fuse_gate_up(tensors: dict) -> dict:
    out = {}
    for name, data in tensors.items():
        if "ffn_gate_exps" in name:  # weights [E, F, D]: gate rows, then up; biases [E, F] alike
            up = tensors[name.replace("gate", "up")]
            out[name.replace("gate_exps", "gate_up_exps")] = np.concatenate([data, up], axis=1)
        elif "ffn_up_exps" not in name:
            out[name] = data
    return out


def test_fused_gate_up_experts_load_alike(files, tmp_path):
    """llama.cpp can write gpt-oss's experts fused (ffn_gate_up_exps: gate rows, then up); the loader takes both."""
    _, fused, _ = load_gguf(_rewrite(files["gpt_oss"], str(tmp_path / "fused.gguf"), _fuse_gate_up))
    _, split, _ = load_gguf(files["gpt_oss"])
    assert sorted(fused) == sorted(split)
    for key in ("layers.0.w_gate_up", "layers.1.b_gate_up"):
        np.testing.assert_array_equal(fused[key], split[key], err_msg=key)


def _write(path: str, arch: str, keys: dict, tensors: dict | None = None) -> str:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    for name, value in (tensors or {"token_embd.weight": np.zeros((8, 64), np.float32)}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_are_refused(tmp_path, files):
    shared = dict(block_count=1, embedding_length=64, feed_forward_length=96)
    shared["attention.head_count"] = 4
    mla = dict(shared, leading_dense_block_count=0, expert_feed_forward_length=16, expert_shared_count=1)
    mla |= {"attention.head_count_kv": 1, "rope.dimension_count": 16}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        load_gguf(_write(str(tmp_path / "a.gguf"), "deepseek2", mla))
    mla["attention.kv_lora_rank"] = 32  # the MQA (split) form without its per-head widths
    with pytest.raises(ValueError, match="key_length_mla"):
        load_gguf(_write(str(tmp_path / "b.gguf"), "deepseek2", mla))
    mla |= {"attention.key_length_mla": 32, "attention.value_length_mla": 16, "expert_gating_func": 3}
    with pytest.raises(ValueError, match="expert_gating_func 3"):
        load_gguf(_write(str(tmp_path / "c.gguf"), "deepseek2", mla))
    oss = dict(shared, expert_count=4, expert_used_count=2, expert_feed_forward_length=32)
    oss |= {"attention.sliding_window": 8, "swiglu_clamp_exp": [7.0, 3.0]}
    with pytest.raises(ValueError, match="per-layer SwiGLU clamps"):
        load_gguf(_write(str(tmp_path / "d.gguf"), "gpt-oss", oss))
    del oss["expert_used_count"]
    with pytest.raises(ValueError, match="expert_used_count"):
        load_gguf(_write(str(tmp_path / "e.gguf"), "gpt-oss", oss))
    extra = {"blk.0.attn_k.weight": np.zeros((2, 64), np.float32)}  # a tensor the MLA decoder has no place for
    path = _rewrite(files["deepseek_v2"], str(tmp_path / "f.gguf"), lambda tensors: tensors | extra)
    with pytest.raises(ValueError, match="unexpected tensor blk.0.attn_k.weight"):
        load_gguf(path)


def test_writer_refuses_what_llama_cpp_cannot_describe(tmp_path):
    src = tmp_path / "oss"
    shutil.copytree(os.path.join(DATA, "gpt_oss"), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "swiglu_alpha": 1.5}))
    with pytest.raises(ValueError, match="swiglu_alpha"):
        convert(str(src), str(tmp_path / "oss.gguf"))
    src = tmp_path / "v3"
    shutil.copytree(os.path.join(DATA, "deepseek_v3"), src)
    cfg = json.loads((src / "config.json").read_text())
    rope = {k: v for k, v in cfg["rope_parameters"].items() if k != "mscale_all_dim"}
    (src / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="mscale_all_dim"):
        convert(str(src), str(tmp_path / "v3.gguf"))
