"""The binaries' multi-host flags: `python -m serving.generate --coordinator_address ...
--num_processes 2 --process_id i` as 2 processes on loopback, 4 CPU devices each, one tp=8 engine over the 8:
process 0 prints the same completions as one single-device process, process 1 prints none. Bad multi-host flags
end at start-up with a message naming the flag.

The model is a random tiny Llama (8 query / 2 KV heads, so tp=8 repeats each KV head) saved as an Orbax
checkpoint with a byte-level tokenizer, so the binary loads it like any model directory.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "--attention_backend=xla",
    "--compilation_cache_dir=",
    "--max_num_seqs=2",
    "--max_num_batched_tokens=16",  # the 2 prompts' prefill is chunked
    "--block_size=4",
    "--num_kv_blocks=80",
    "--max_model_len=64",
    "--decode_steps=4",
    "--max_tokens=10",
    "--nowarmup_run",
    "--prompt=Hello there, sea",
    "--prompt=abc",
]


def _tiny_checkpoint(directory: str) -> None:
    import jax.numpy as jnp
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from checkpoints import orbax_io
    from checkpoints.tokenizer import Tokenizer
    from model.config import ModelConfig
    from model.transformer import model_params, random_model

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    tokenizer = Tokenizer(hf, eos_token_ids=(0,))
    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, vocab_size=len(vocab), eos_token_ids=(0,))
    orbax_io.save(directory, cfg, model_params(random_model(cfg, jnp.float32, seed=3)), tokenizer)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """One saved tiny checkpoint for every test of the module (read-only to the binaries)."""
    model = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    _tiny_checkpoint(model)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(args: list[str], devices: int) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONPATH": ROOT}
    return subprocess.Popen(
        [sys.executable, "-m", "serving.generate", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _completions(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("completion (")]


@pytest.mark.slow
def test_generate_as_two_processes_matches_one(tiny_model):
    model = tiny_model
    port = str(_free_port())
    multi = [
        _generate(
            [f"--model={model}", *COMMON, "--tensor_parallel_size=8", f"--coordinator_address=127.0.0.1:{port}"]
            + ["--num_processes=2", f"--process_id={i}"],
            devices=4,
        )
        for i in range(2)
    ]
    single = _generate([f"--model={model}", *COMMON], devices=1)
    replicas = _generate([f"--model={model}", *COMMON, "--data_parallel_size=2", "--tensor_parallel_size=2"], 8)
    procs = [*multi, single, replicas]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for name, p, (out, err) in zip(("process 0", "process 1", "single", "dp2 x tp2"), procs, outs):
        assert p.returncode == 0, f"{name}:\n{out[-2000:]}\n{err[-4000:]}"
    want = _completions(outs[2][0])
    assert len(want) == 2 and all("(10 tokens" in line for line in want), outs[2][0]
    assert _completions(outs[0][0]) == want, (outs[0][0], outs[2][0])
    assert _completions(outs[3][0]) == want, (outs[3][0], outs[2][0])  # data parallel through the binary
    # gloo's own chatter (its lines may interleave, so a fragment can start a line): none of ours
    follower = [line for line in outs[1][0].splitlines() if "[Gloo]" not in line and "peer ranks" not in line]
    assert follower == [] and "loaded" not in outs[1][1], outs[1]  # process 0 alone prints


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_processes=2"], "num_processes=2 needs --coordinator_address"),
        (["--num_processes=2", "--process_id=2", "--coordinator_address=127.0.0.1:1"], "process_id=2 must be in"),
        (["--num_processes=0"], "num_processes must be >= 1, got 0"),
    ],
)
def test_bad_multihost_flags_are_refused(flags, message):
    proc = _generate(["--nowarmup_run", *flags], devices=1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and message in err and "Traceback" not in err, (out, err)


def _binary(module: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, args",
    [
        ("serving.generate", ["--nowarmup_run", "--max_tokens=2", "--prompt=abc"]),  # plain: no chat template
        ("serving.server", ["--port=0", "--nowarmup"]),
        ("benchmarks.bench", ["--mode=latency", "--random_weights", "--model_preset=tiny", "--context=8"]),
    ],
    ids=["generate", "server", "bench"],
)
def test_binaries_refuse_a_mesh_that_does_not_fit(module, args, tmp_path, tiny_model):
    """The parallel flags reach the engine of every binary, and a mesh with more devices than exist (8 here) or
    heads that do not divide stops it at start-up with the wrong number named. generate and server load the
    module's tiny checkpoint (8 heads; loading the default SmolLM2 in each of their four processes only cost
    time before the same refusal), the bench its tiny preset (4 heads)."""
    if module == "benchmarks.bench":
        args, tp, heads = [*args, f"--out_dir={tmp_path}"], 8, "num_heads=4"
    else:
        args, tp, heads = [*args, f"--model={tiny_model}"], 3, "num_heads=8"
    cases = [
        (
            [
                "--data_parallel_size=2",
                "--tensor_parallel_size=2",
                "--expert_parallel_size=1",
                "--pipeline_parallel_size=4",
            ],
            "data_parallel_size=2 x tensor_parallel_size=2 x pipeline_parallel_size=4 x expert_parallel_size=1 needs 16 "
            "devices; only 8 exist",
        ),
        ([f"--tensor_parallel_size={tp}"], f"tensor_parallel_size={tp} does not divide {heads}"),
    ]
    for flags, message in cases:
        proc = _binary(module, [*args, *flags])
        assert proc.returncode != 0 and message in proc.stderr, (flags, proc.stdout[-2000:], proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


REFERENCE = r"""
import json, sys
from serving.engine.llm import LLM
llm = LLM(sys.argv[1], attention_backend="xla", compilation_cache_dir="", max_model_len=64, warmup=False)
print("TEXT" + json.dumps(llm.generate(["Hello there, sea"], max_tokens=10, temperature=0.0)[0].text))
"""


@pytest.mark.slow
def test_server_as_two_processes_serves_what_one_engine_generates(tiny_model):
    """`python -m serving.server` with the multi-host flags on 2 processes x 4 CPU devices (tp=8): process 0
    answers HTTP with the text a one-device LLM generates; on SIGTERM it releases process 1, and both exit 0."""
    import signal
    import time

    import httpx

    model = tiny_model
    port, http_port = str(_free_port()), _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": ROOT}
    args = [f"--model={model}", "--attention_backend=xla", "--compilation_cache_dir=", "--max_model_len=64"]
    args += ["--nowarmup", "--tensor_parallel_size=8", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "serving.server", *args, f"--process_id={i}", f"--port={http_port + i}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    reference = subprocess.Popen(
        [sys.executable, "-c", REFERENCE, model],
        cwd=ROOT,
        env={**env, "XLA_FLAGS": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url, deadline = f"http://127.0.0.1:{http_port}", time.monotonic() + 400
        while True:
            assert procs[0].poll() is None and procs[1].poll() is None, "a server process exited early"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the multi-host server never became healthy"
            time.sleep(1)
        body = {"model": "tiny", "prompt": "Hello there, sea", "max_tokens": 10, "temperature": 0.0}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        with pytest.raises(httpx.HTTPError):  # process 1 serves nothing
            httpx.get(f"http://127.0.0.1:{http_port + 1}/health", timeout=2)
        procs[0].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120) for p in procs]
        ref_out, ref_err = reference.communicate(timeout=300)
    finally:
        for p in [*procs, reference]:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{out[-2000:]}\n{err[-4000:]}"
    assert reference.returncode == 0, ref_err[-3000:]
    assert got == json.loads(ref_out.split("TEXT", 1)[1]), (got, ref_out)


@pytest.mark.slow
def test_bench_as_two_processes(tmp_path):
    """`python -m benchmarks.bench --mode latency` with the multi-host flags (2 processes x 2 CPU devices, tp=4):
    both exit 0, process 0 alone writes the results, measured on the 4 devices of the job."""
    port = str(_free_port())
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": ROOT}
    args = ["--mode=latency", "--random_weights", "--model_preset=tiny", "--context=8", "--latency_tokens=8"]
    args += ["--batch_size=2", "--tensor_parallel_size=4", "--attention_backend=xla", "--compilation_cache_dir="]
    args += ["--max_num_batched_tokens=16"]  # the bench compiles every bucket: one token bucket, not 16 .. 256
    args += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench", *args, f"--process_id={i}", f"--out_dir={tmp_path / str(i)}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{out[-2000:]}\n{err[-4000:]}"
    record = json.loads((tmp_path / "0" / "latency_tiny.json").read_text())
    assert record["device"].startswith("cpu") and " x4 " in record["device"], record["device"]
    assert record["results"]["load_s"] > 0 and not (tmp_path / "1").exists()


@pytest.mark.slow
def test_data_parallel_across_processes_is_refused(tiny_model):
    """Replicas are built within one process; asked across processes, both processes stop naming the numbers."""
    model = tiny_model
    port = str(_free_port())
    flags = [f"--model={model}", *COMMON, "--data_parallel_size=2", f"--coordinator_address=127.0.0.1:{port}"]
    procs = [_generate([*flags, "--num_processes=2", f"--process_id={i}"], devices=4) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2 and "data_parallel_size=2 with num_processes=2 is not supported yet" in err, err[
            -3000:
        ]
