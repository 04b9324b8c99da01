"""Perplexity through the server by lm-eval vs the offline figure of the same text.

    PYTHONPATH=. python benchmarks/lm_eval_ppl.py --out benchmarks/results/lm_eval_ppl.json [--server_args ...]

1. Documents: the start (`--doc_chars` characters) of held-out evaluation files of benchmarks/quant_quality.py
   (prose: licence texts, code: Python standard library), never its calibration files.
2. lm-eval's `local-completions` model scores them as a local `loglikelihood_rolling` task against
   `python -m serving.server` on a loopback port (remote tokenizer: /tokenize; token-id prompts; echo + logprobs,
   max_tokens 1, whose logprob lm-eval drops), in windows of `--max_length` - 1 tokens (lm-eval's
   get_rolling_token_windows with its prefix token first: see `windows`).
3. Offline: the same documents tokenised by the checkpoint's tokenizer, the same windows (lm-eval's own window
   function, so both sides score identical token sequences), scored by a plain float32 forward of the model
   (benchmarks/quant_quality.py `forward`, no KV cache, no server, no engine).
4. Compared per document (summed log-likelihood) and per domain (token perplexity exp(-sum ll / tokens), and
   lm-eval's word_perplexity against exp(-sum ll / words) with its word count).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import local_server
from benchmarks import quant_quality as qq

DOCS = {"prose": ["MPL-2.0", "LGPL-2.1"], "code": ["heapq.py", "textwrap.py"]}
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def documents(doc_chars: int) -> list[dict]:
    """[{domain, name, text}]: the first `doc_chars` characters of each held-out file (cut at a line end)."""
    out = []
    for domain, names in DOCS.items():
        for name in names:
            if name not in qq.SPLITS[domain]["eval"]:
                raise ValueError(f"{name} is not in the held-out split of {domain}")
            text = qq.read(domain, name)[:doc_chars]
            out.append(dict(domain=domain, name=name, text=text[: text.rfind("\n") + 1] or text))
    return out


def run_lm_eval(url: str, model: str, docs: list[dict], max_length: int, workdir: str) -> list[float]:
    """lm-eval local-completions on the documents as one loglikelihood_rolling task; summed ll per document."""
    data = os.path.join(workdir, "held_out.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(dict(text=d["text"])) + "\n" for d in docs)
    with open(os.path.join(workdir, "held_out_ppl.yaml"), "w") as f:
        f.write(TASK.format(name="held_out_ppl", data=data))
    model_args = (
        f"model={model},base_url={url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
        f"num_concurrent=1,max_retries=1,max_length={max_length}"
    )
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "lm_eval"),
        *("--model", "local-completions", "--model_args", model_args, "--tasks", "held_out_ppl"),
        *("--include_path", workdir, "--output_path", os.path.join(workdir, "out"), "--log_samples"),
    ]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"lm_eval failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(workdir, "out")) for f in fs]
    (samples,) = [f for f in files if os.path.basename(f).startswith("samples_held_out_ppl")]
    rows = sorted((json.loads(line) for line in open(samples)), key=lambda r: r["doc_id"])
    return [float(np.ravel(r["resps"])[0]) for r in rows]


def _tokenize(url: str, text: str) -> list[int]:
    body = dict(prompt=text, add_special_tokens=False)  # what lm-eval's RemoteTokenizer.encode sends
    return httpx.post(url + "/tokenize", json=body, timeout=60).json()["tokens"]


def prefix_token(url: str) -> int:
    """lm-eval's remote prefix_token_id: bos_token_id or eos_token_id, each the first id of its text."""
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    special = [_tokenize(url, info[k])[0] if info.get(k) else None for k in ("bos_token", "eos_token")]
    return special[0] or special[1]


def windows(ids: list[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's windows for its model argument `max_length`: (context, continuation) pairs. TemplateAPI keeps
    max_length - 1 (one position for the token it asks the server to generate, whose logprob it drops) and its
    loglikelihood_rolling windows predict max_seq_len = that - 1 tokens, so each request is max_length - 1 long."""
    from lm_eval import utils

    rolling = utils.get_rolling_token_windows(ids, prefix_token=prefix, max_seq_len=max_length - 2, context_len=1)
    return [utils.make_disjoint_window(w) for w in rolling]


def offline_loglik(model, pairs) -> float:
    """Summed log-probability of each continuation given its context, one float32 forward per window."""
    total = 0.0
    for ctx, cont in pairs:
        tokens = np.asarray(ctx + cont, np.int32)[None]
        logp = jax.nn.log_softmax(qq.forward(model, tokens)[0].astype(jnp.float32), axis=-1)
        rows = np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
        total += float(np.sum(np.asarray(logp, np.float64)[rows, cont]))
    return total


def summarise(docs, lm_ll, off_ll, n_tokens):
    per_domain = {}
    for domain in DOCS:
        idx = [i for i, d in enumerate(docs) if d["domain"] == domain]
        words = sum(len(re.split(r"\s+", docs[i]["text"])) for i in idx)
        toks = sum(n_tokens[i] for i in idx)
        lm, off = sum(lm_ll[i] for i in idx), sum(off_ll[i] for i in idx)
        row = dict(tokens=toks, words=words, lm_eval_ll=lm, offline_ll=off)
        row |= dict(lm_eval_token_ppl=float(np.exp(-lm / toks)), offline_token_ppl=float(np.exp(-off / toks)))
        row |= dict(lm_eval_word_ppl=float(np.exp(-lm / words)), offline_word_ppl=float(np.exp(-off / words)))
        row["token_ppl_diff_pct"] = 100.0 * (row["lm_eval_token_ppl"] / row["offline_token_ppl"] - 1.0)
        row["word_ppl_diff_pct"] = 100.0 * (row["lm_eval_word_ppl"] / row["offline_word_ppl"] - 1.0)
        per_domain[domain] = row
    return per_domain


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/lm_eval_ppl.json")
    parser.add_argument("--max_length", type=int, default=512, help="lm-eval's max_length = max_model_len")
    parser.add_argument("--doc_chars", type=int, default=6000)
    parser.add_argument("--server_args", default="", help="extra serving.server flags, e.g. '--dtype float32'")
    args = parser.parse_args(argv)
    t0 = time.time()
    docs = documents(args.doc_chars)
    port = local_server.free_port()
    url = f"http://127.0.0.1:{port}"
    server_args = ["--max_model_len", str(args.max_length), "--attention_backend", "xla", "--dtype", "float32"]
    proc = local_server.start_server(port, server_args + shlex.split(args.server_args))
    try:
        local_server.wait_healthy(url, proc, timeout=1800)
        server_ids = [_tokenize(url, d["text"]) for d in docs]
        prefix = prefix_token(url)
        with tempfile.TemporaryDirectory() as workdir:
            (served,) = httpx.get(url + "/v1/models", timeout=30).json()["data"]
            lm_ll = run_lm_eval(url, served["id"], docs, args.max_length, workdir)
    finally:
        local_server.stop_server(proc)
    lm_s = time.time() - t0
    from checkpoints.loader import load_checkpoint
    from model import transformer

    ckpt = load_checkpoint()
    model = transformer.build_model(ckpt.config, ckpt.params, jnp.float32)
    ids = [ckpt.tokenizer.encode(d["text"], False) for d in docs]  # as lm-eval's /tokenize: no special tokens
    same_tokens = [s == i for s, i in zip(server_ids, ids)]
    off_ll = [offline_loglik(model, windows(i, prefix, args.max_length)) for i in ids]
    result = dict(
        server_args=server_args + shlex.split(args.server_args),
        max_length=args.max_length,
        prefix_token_id=prefix,
        docs=[dict(domain=d["domain"], name=d["name"], chars=len(d["text"]), tokens=len(i)) for d, i in zip(docs, ids)],
        server_tokens_equal_offline=same_tokens,
        per_doc=[dict(lm_eval_ll=a, offline_ll=b) for a, b in zip(lm_ll, off_ll)],
        per_domain=summarise(docs, lm_ll, off_ll, [len(i) for i in ids]),
        lm_eval_s=lm_s,
        elapsed_s=time.time() - t0,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for domain, row in result["per_domain"].items():
        print(
            f"{domain:6s} tokens {row['tokens']:5d}  token ppl lm-eval {row['lm_eval_token_ppl']:.4f} offline "
            f"{row['offline_token_ppl']:.4f} ({row['token_ppl_diff_pct']:+.4f}%)  word ppl lm-eval "
            f"{row['lm_eval_word_ppl']:.4f} offline {row['offline_word_ppl']:.4f} ({row['word_ppl_diff_pct']:+.4f}%)"
        )
    print("server tokens == offline tokens:", same_tokens, f"elapsed {result['elapsed_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
