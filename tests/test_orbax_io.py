"""Orbax save/restore (host, 1-device and 8-device meshes) and the checkpoints.convert binary.

8 forced CPU devices come from tests/test_sharding.py's import (XLA_FLAGS before JAX starts), with the same
fallback: when JAX started too early, `test_module_in_fresh_process` runs this file in a new process.
"""

import json  # noqa: E402
import os
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_hf import write_tiny_hf  # noqa: E402
from test_sharding import eight_devices, run_in_fresh_process  # noqa: F401  (first: sets XLA_FLAGS)
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import models, pre_tokenizers

from checkpoints import orbax_io  # noqa: E402
from checkpoints.gguf import expected_shapes  # noqa: E402
from checkpoints.tokenizer import Tokenizer  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.kv import NoCache  # noqa: E402
from model.transformer import build_model  # noqa: E402
from sharding.mesh import ParallelConfig, make_mesh  # noqa: E402
from sharding.rules import param_shardings  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = [1, 17, 255, 3, 99, 400, 7]


def test_module_in_fresh_process():
    run_in_fresh_process(__file__)


def random_params(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (0.2 * rng.standard_normal(s)).astype(np.float32) for n, s in expected_shapes(config).items()}


def tiny_tokenizer() -> Tokenizer:
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(hf=hf, bos_token_id=1, eos_token_ids=(2,), add_bos=True, chat_template="{{ messages }}")


def logits(config: ModelConfig, params: dict, tokens=TOKENS) -> np.ndarray:
    """Logits [1, T, V] of build_model(config, params) on one sequence."""
    model = build_model(config, params)
    tokens_bt = jnp.asarray([tokens], jnp.int32)
    positions_bt = jnp.arange(len(tokens), dtype=jnp.int32)[None]
    out, _ = model(tokens_bt, positions_bt, None, NoCache(valid_len=jnp.asarray([len(tokens)], jnp.int32)))
    return np.asarray(out)


def assert_bit_identical(restored: dict, params: dict):
    assert set(restored) == set(params)
    for name, value in params.items():
        got = np.asarray(restored[name])
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert got.tobytes() == value.tobytes(), name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = ModelConfig.tiny(attention_bias=True)
    params = random_params(config)
    params["layers.1.wv"] = params["layers.1.wv"].astype(ml_dtypes.bfloat16)  # Stored dtypes are kept.
    directory = str(tmp_path_factory.mktemp("orbax") / "tiny")
    orbax_io.save(directory, config, params, tiny_tokenizer())
    return directory, config, params


def test_restore_to_host(saved):
    directory, config, params = saved
    assert orbax_io.is_orbax_dir(directory)
    restored_config, restored, tokenizer = orbax_io.restore(directory)
    assert restored_config == config
    assert all(isinstance(v, np.ndarray) for v in restored.values())
    assert_bit_identical(restored, params)
    assert tokenizer.encode("hello world") == [1, 3, 4]
    assert (tokenizer.eos_token_ids, tokenizer.chat_template) == ((2,), "{{ messages }}")
    np.testing.assert_array_equal(logits(config, restored), logits(config, params))


def test_restore_onto_one_device_mesh(saved):
    directory, config, params = saved
    mesh = make_mesh(ParallelConfig(), jax.devices("cpu")[:1])
    _, restored, _ = orbax_io.restore(directory, mesh=mesh)
    assert all(isinstance(v, jax.Array) and v.sharding.mesh == mesh for v in restored.values())
    assert_bit_identical(restored, params)
    np.testing.assert_array_equal(logits(config, restored), logits(config, params))


def test_restore_onto_eight_device_mesh(saved):
    directory, config, params = saved
    mesh = make_mesh(ParallelConfig(dp=2, tp=4), jax.devices("cpu")[:8])
    _, restored, _ = orbax_io.restore(directory, mesh=mesh)
    want = param_shardings(params, mesh, head_dim=config.head_dim)
    for name, value in restored.items():
        assert value.sharding == want[name], name
        assert value.addressable_shards[0].data.shape == want[name].shard_shape(value.shape), name
    assert restored["layers.0.wq"].sharding.spec == jax.P(None, "tensor")
    assert_bit_identical(restored, params)
    # Tensor-parallel matmuls reduce partial sums across devices, so logits agree to rounding, not bit for bit.
    np.testing.assert_allclose(logits(config, restored), logits(config, params), rtol=2e-5, atol=2e-5)


def test_restore_with_dtype(saved):
    directory, config, params = saved
    _, restored, _ = orbax_io.restore(directory, dtype=jnp.bfloat16)
    assert_bit_identical(restored, {k: v.astype(ml_dtypes.bfloat16) for k, v in params.items()})


def test_overwrite_rules(saved, tmp_path):
    directory, config, params = saved
    with pytest.raises(FileExistsError, match="already exists"):
        orbax_io.save(directory, config, params)
    orbax_io.save(directory, config, params, overwrite=True)  # Without a tokenizer this time.
    assert orbax_io.restore(directory)[2] is None
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing"):
        orbax_io.save(str(tmp_path), config, params, overwrite=True)
    assert (tmp_path / "precious.txt").exists()
    assert not orbax_io.is_orbax_dir(str(tmp_path))


def test_mismatches_raise(tmp_path):
    config = ModelConfig.tiny()
    params = random_params(config)
    with pytest.raises(ValueError, match="missing layers.1.w_up"):
        orbax_io.save(str(tmp_path / "a"), config, {k: v for k, v in params.items() if k != "layers.1.w_up"})
    with pytest.raises(ValueError, match="not in the config"):
        orbax_io.save(str(tmp_path / "a"), config, {**params, "layers.0.bq": np.zeros(64, np.float32)})
    orbax_io.save(str(tmp_path / "b"), config, params)
    with open(tmp_path / "b" / "config.json", "w") as f:
        f.write(config.replace(num_layers=3).to_json())
    with pytest.raises(ValueError, match="layers.2.wq"):
        orbax_io.restore(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="not an Orbax checkpoint"):
        orbax_io.restore(str(tmp_path))


# checkpoints.convert ---------------------------------------------------------------------------------------------


def start_convert(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "XLA_FLAGS": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "checkpoints.convert", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_convert(*args: str) -> subprocess.CompletedProcess:
    proc = start_convert(*args)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_convert_hf_checkpoint(tmp_path):
    src, dst = str(tmp_path / "hf"), str(tmp_path / "orbax")
    write_tiny_hf(src, num_shards=2)
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    proc = run_convert("--src", src, "--dst", dst, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "reading 21/21 (100%)" in proc.stderr and "Traceback" not in proc.stderr
    config, params, tokenizer = orbax_io.restore(dst)
    assert config.num_layers == hf_config["num_hidden_layers"] and tokenizer is None
    assert all(v.dtype == np.float32 for v in params.values())
    from checkpoints.hf import load_hf

    _, hf_params = load_hf(src, dtype=np.float32)
    assert_bit_identical(params, hf_params)
    proc = run_convert("--src", src, "--dst", dst)
    assert proc.returncode == 1 and "--overwrite" in proc.stderr
    assert run_convert("--src", src, "--dst", dst, "--overwrite", "--dtype", "bfloat16").returncode == 0
    assert orbax_io.restore(dst)[1]["embed"].dtype == ml_dtypes.bfloat16
    proc = run_convert("--src", src, "--dst", src, "--overwrite")  # Never deletes a non-Orbax directory.
    assert proc.returncode == 1 and "refusing" in proc.stderr and os.path.isfile(os.path.join(src, "config.json"))


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--src", "/nonexistent/model.gguf", "--dst", "DST"], 1, "model not found"),
        (["--src", "SRC", "--dst", "DST"], 1, "not a GGUF file, an HF"),
        (["--dst", "DST"], 2, "--src and --dst are required"),
        (["--src", "SRC", "--dst", "DST", "extra"], 2, "unexpected arguments"),
        (["--src", "SRC", "--dst", "DST", "--dtype", "float16"], 1, "value should be one of"),
    ],
)
def test_convert_errors_are_one_line(tmp_path, args, code, message):
    os.makedirs(tmp_path / "src")  # An empty directory: neither GGUF, HF nor Orbax.
    args = [a.replace("SRC", str(tmp_path / "src")).replace("DST", str(tmp_path / "dst")) for a in args]
    proc = run_convert(*args)
    assert proc.returncode == code and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2


def write_tiny_gguf(path: str) -> None:
    """A 2-layer Llama GGUF with a byte-level BPE tokenizer (specials, merges, chat template) in its metadata.

    Tensors mix F32, F16 and Q8_0, so conversion must keep the dequantised values exactly; attn_q/attn_k carry
    llama.cpp's row permutation, which the loader undoes.
    """
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["He", "ll", "Hell", "Hello"]
    merges = ["H e", "l l", "He ll", "Hell o"]
    d, heads, kv_heads, ff, layers = 64, 2, 1, 96, 2
    hd = d // heads
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    def add(name, shape, kind=T.F32):  # ggml row-major [out, in]
        x = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(name, x if kind == T.F32 else quants.quantize(x, kind), raw_dtype=None if kind == T.F32 else kind)

    add("token_embd.weight", (len(tokens), d), T.F16)
    add("output_norm.weight", (d,))
    for i in range(layers):
        for name, shape, kind in (
            ("attn_norm", (d,), T.F32),
            ("attn_q", (d, d), T.Q8_0),
            ("attn_k", (kv_heads * hd, d), T.Q8_0),
            ("attn_v", (kv_heads * hd, d), T.F16),
            ("attn_output", (d, d), T.F32),
            ("ffn_norm", (d,), T.F32),
            ("ffn_gate", (ff, d), T.Q8_0),
            ("ffn_up", (ff, d), T.F16),
            ("ffn_down", (d, ff), T.F32),
        ):
            add(f"blk.{i}.{name}.weight", shape, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_convert_gguf_logits_bit_identical(tmp_path):
    """GGUF -> Orbax keeps the config, the dequantised parameters bit for bit, the tokenizer and the logits."""
    from checkpoints.gguf import load_gguf

    src, dst = str(tmp_path / "tiny.gguf"), str(tmp_path / "tiny_orbax")
    write_tiny_gguf(src)
    proc = start_convert("--src", src, "--dst", dst)
    gguf_config, gguf_params, meta = load_gguf(src)  # Overlaps with the conversion.
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    n = len(gguf_params)  # each tensor read once, under "reading"; then the save says what it does
    assert stderr.count(f"reading {n}/{n} (100%)") == 1 and "loading" not in stderr, stderr
    assert stderr.index("reading") < stderr.index(f"saving {n} tensors") < stderr.index("saved in"), stderr
    config, params, tokenizer = orbax_io.restore(dst)
    assert config == gguf_config and config.num_layers == 2
    assert config.eos_token_ids == (2, 0)  # the eos id, then <|endoftext|> found in the vocabulary
    assert_bit_identical(params, gguf_params)
    gguf_tokenizer = Tokenizer.from_gguf_metadata(meta, gguf_config.eos_token_ids)
    text = "<|im_start|>user\nHello 123 wörld!<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == gguf_tokenizer.encode(text)
    assert ids[0] == 1 and ids[-1] == 2 and meta.tokens.index("Hello") in ids  # specials and merges survived
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.add_bos, tokenizer.chat_template) == (
        gguf_tokenizer.bos_token_id,
        gguf_tokenizer.eos_token_ids,
        gguf_tokenizer.add_bos,
        gguf_tokenizer.chat_template,
    )
    np.testing.assert_array_equal(logits(config, params, ids), logits(gguf_config, gguf_params, ids))


def test_checkpoints_import_nothing_from_serving():
    """checkpoints/ sits below serving/ (the converter quantises through model/quantize_model.py)."""
    import ast

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")
    for name in sorted(f for f in os.listdir(root) if f.endswith(".py")):
        tree = ast.parse(open(os.path.join(root, name), encoding="utf-8").read())
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m == "serving" or m.startswith("serving.") for m in modules), (name, modules)
