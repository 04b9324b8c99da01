"""Acceptance of trained Medusa heads beside the n-gram proposer, per domain, on SmolLM2 (CPU; a few minutes).

    PYTHONPATH=. python benchmarks/medusa_acceptance.py --heads benchmarks/results/medusa_heads_smollm2 \
        --max_tokens 64 --out benchmarks/results/medusa_acceptance_smollm2.json

Greedy generation with plain decoding on the Lab 02 prompts (benchmarks/spec_acceptance.py: held-out stdlib code
heapq / textwrap / shlex, licence prose, copy-heavy chat turns), then a replay of speculative greedy decoding over
the generated sequence, as `serving.spec.proposers.replay_greedy` does for the n-gram proposer: under greedy
decoding the output is the target's argmax chain whatever the drafts, so a draft's accepted prefix is its longest
prefix equal to the tokens generated next. For the heads, a pass that has emitted up to position e drafts
argmax head_i(h_{e-1}) for i < k, h_{e-1} being the target's hidden state whose logits chose token e (the state
the engine hands the proposer); those states come from one contiguous target pass over prompt + generation.
Reported per domain and k = 1..num_heads: acceptance a = accepted / trials (trials end at the first rejection),
emitted tokens per pass, and each head's top-1 agreement with the generated token it predicts.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import jax.numpy as jnp
import numpy as np

from benchmarks.spec_acceptance import build_prompts
from model.kv import NoCache
from model.medusa import head_logits, load_heads
from serving.engine.llm import LLM
from serving.spec.proposers import NgramProposer, replay_greedy


def head_drafts(llm: LLM, heads, seq: list[int]) -> np.ndarray:
    """argmax of every head at every position of `seq` [T, H] (from the target's final-normed hidden states)."""
    ids = jnp.asarray(seq)[None]
    t = ids.shape[1]
    _, _, hidden = llm.model(ids, jnp.arange(t)[None], None, NoCache(jnp.array([t])), return_hidden=True)
    return np.asarray(jnp.argmax(head_logits(heads, llm.model, hidden[0]), axis=-1))


def replay_heads(drafts_th: np.ndarray, prompt_len: int, seq: list[int], k: int) -> dict:
    """replay_greedy's walk with the heads' drafts: at emitted position e, drafts drafts_th[e - 1, :k]."""
    pos, passes, drafted, accepted, trials = prompt_len, 0, 0, 0, 0
    while pos < len(seq):
        d = min(k, len(seq) - pos - 1)
        m = 0
        while m < d and int(drafts_th[pos - 1, m]) == seq[pos + 1 + m]:
            m += 1
        passes, drafted, accepted = passes + 1, drafted + d, accepted + m
        trials += m + (1 if m < d else 0)
        pos += m + 1
    return dict(passes=passes, drafted=drafted, accepted=accepted, trials=trials, acceptance=accepted / max(trials, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", required=True, help="heads checkpoint dir (python -m serving.train_heads)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--prompt_chars", type=int, default=600)
    ap.add_argument("--out", default="benchmarks/results/medusa_acceptance_smollm2.json")
    args = ap.parse_args()
    heads, notes = load_heads(args.heads)
    llm = LLM(args.model, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=160)
    result = dict(
        command="PYTHONPATH=. python benchmarks/medusa_acceptance.py "
        + " ".join(f"--{k}={v}" for k, v in vars(args).items()),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        host=f"{platform.processor() or platform.machine()}, {platform.system()}",
        model=llm.name,
        heads=dict(path=args.heads, num_heads=heads.cfg.num_heads, steps=notes.get("steps")),
        domains={},
    )
    ks = range(1, heads.cfg.num_heads + 1)
    for domain, items in build_prompts(args.prompt_chars).items():
        prompts = [llm.encode_prompt(text, chat=chat) for text, chat in items]
        outs = llm.generate(prompts, max_tokens=args.max_tokens, temperature=0.0)
        seqs = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
        drafts = [head_drafts(llm, heads, s) for s in seqs]
        row = dict(tokens=sum(len(o.token_ids) for o in outs), medusa={}, ngram={})
        for k in ks:
            for name, walks in (
                ("medusa", [replay_heads(d, len(p), s, k) for d, p, s in zip(drafts, prompts, seqs)]),
                ("ngram", [replay_greedy(NgramProposer(), p, s[len(p) :], k) for p, s in zip(prompts, seqs)]),
            ):
                tot = {key: sum(w[key] for w in walks) for key in ("passes", "drafted", "accepted", "trials")}
                row[name][k] = dict(
                    acceptance=round(tot["accepted"] / max(tot["trials"], 1), 4),
                    emitted_per_pass=round(row["tokens"] / tot["passes"], 3),
                    drafted=tot["drafted"],
                    accepted=tot["accepted"],
                )
        row["head_top1"] = [
            round(
                float(
                    np.mean(
                        [
                            d[q - 1, i] == s[q + 1 + i]
                            for d, p, s in zip(drafts, prompts, seqs)
                            for q in range(len(p), len(s) - 1 - i)
                        ]
                    )
                ),
                4,
            )
            for i in range(heads.cfg.num_heads)
        ]
        result["domains"][domain] = row
        print(
            domain,
            json.dumps({m: {k: row[m][k]["acceptance"] for k in ks} for m in ("medusa", "ngram")}),
            row["head_top1"],
            flush=True,
        )
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
