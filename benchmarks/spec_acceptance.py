"""N-gram proposer acceptance on SmolLM2: acceptance per domain, and the sweep of k against
(1 - a^(k+1)) / (1 - a). CPU; a few minutes.

    PYTHONPATH=. python benchmarks/spec_acceptance.py --max_tokens 128 \
        --out benchmarks/results/spec_acceptance_ngram_smollm2.json      # and the .png beside it

Greedy generation with `LLM(...).generate(..., temperature=0)` on text not written here (code: Python
standard-library sources; prose: the licence texts under /usr/share/common-licenses; copy-heavy: chat prompts that
ask to repeat or summarise a passage they contain). Under greedy decoding the speculative output is the target's
argmax chain whatever the drafts, so replaying the proposer over the generated sequence
(`serving.spec.proposers.replay_greedy`) gives exactly what speculative decoding would have accepted: a draft's
accepted prefix is its longest prefix equal to the tokens generated next. Reported per domain and k = 1..7:
  * acceptance a = accepted / trials (per-token, trials end at the first rejection);
  * draft rate r = passes with >= 1 draft / passes (the n-gram proposer drafts only when a suffix matches);
  * emitted per pass, measured (= generated tokens / passes), and two predictions from the formula: with drafts
    on every pass, E(a, k) = (1 - a^(k+1)) / (1 - a), and mixed with the passes that draft nothing,
    (1 - r) + r E(a, k). The formula assumes independent acceptances at a fixed rate; n-gram acceptances are
    correlated (a copied span is accepted in runs), which the measured column shows.
Also per domain: the fraction of the output's 8-grams repeated from earlier in the output (greedy looping) and
found in the prompt (copying), which say where the accepted drafts came from.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sysconfig
import time

from serving.spec.proposers import NgramProposer, replay_greedy
from serving.spec.rule import expected_tokens_per_pass

STDLIB = sysconfig.get_paths()["stdlib"]  # this interpreter's standard library (heapq.py etc. exist in every 3.x)
LICENSES = "/usr/share/common-licenses"
CODE_FILES = ("heapq.py", "textwrap.py", "shlex.py")
PROSE_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0")


def _chunk(path: str, start_frac: float, chars: int) -> str:
    """About `chars` characters of `path` from `start_frac` of the way in, cut at line boundaries."""
    text = open(path, encoding="utf-8").read()
    start = text.rfind("\n", 0, int(len(text) * start_frac)) + 1
    end = text.rfind("\n", start, start + chars)
    return text[start : end if end > start else start + chars]


def _find(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(directory, "*")))
    raise FileNotFoundError(f"{path} missing (have {len(found)} files in {directory})")


def build_prompts(chars: int) -> dict[str, list[tuple[str, bool]]]:
    """domain -> [(prompt, chat)]: raw continuation for code and prose, chat turns for copy-heavy."""
    code = [(_chunk(_find(STDLIB, f), 0.3, chars), False) for f in CODE_FILES]
    prose = [(_chunk(_find(LICENSES, f), 0.3, chars), False) for f in PROSE_FILES]
    passage_prose = _chunk(_find(LICENSES, "GPL-3"), 0.6, chars // 2)
    passage_code = _chunk(_find(STDLIB, "bisect.py"), 0.2, chars // 2)
    copy = [
        (f"Repeat the following passage exactly, word for word:\n\n{passage_prose}", True),
        (f"Repeat the following code exactly, without changes:\n\n{passage_code}", True),
        (f"Summarise the following passage, quoting its key sentences:\n\n{passage_prose}", True),
    ]
    return {"code": code, "prose": prose, "copy_heavy": copy}


def repetition(prompt_ids, generated, n: int = 8) -> dict:
    """Where the generated text's n-grams come from: the fraction also found earlier in the generated text itself
    (the greedy model looping) and the fraction found in the prompt (copying)."""
    own = in_prompt = total = 0
    for p, g in zip(prompt_ids, generated):
        prompt_grams = {tuple(p[i : i + n]) for i in range(len(p) - n + 1)}
        seen = set()
        for i in range(len(g) - n + 1):
            gram = tuple(g[i : i + n])
            total += 1
            own += gram in seen
            in_prompt += gram in prompt_grams
            seen.add(gram)
    return dict(n=n, ngrams=total, repeated_in_output=own / max(total, 1), found_in_prompt=in_prompt / max(total, 1))


def sweep(proposer, prompt_ids, generated, ks) -> list[dict]:
    rows = []
    for k in ks:
        tot = dict(passes=0, tokens=0, drafted=0, accepted=0, trials=0, proposed_passes=0)
        for p, g in zip(prompt_ids, generated):
            r = replay_greedy(proposer, p, g, k)
            for key in tot:
                tot[key] += r[key]
        a = tot["accepted"] / tot["trials"] if tot["trials"] else 0.0
        rate = tot["proposed_passes"] / tot["passes"]
        formula = expected_tokens_per_pass(a, k)
        rows.append(
            dict(
                k=k,
                **tot,
                acceptance=a,
                draft_rate=rate,
                emitted_per_pass=tot["tokens"] / tot["passes"],
                formula_all_passes=formula,
                formula_mixed=(1 - rate) + rate * formula,
            )
        )
    return rows


def plot(result: dict, path: str) -> None:
    """Emitted tokens per pass against k per domain: measured, and the formula at the measured acceptance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (domain, d) in enumerate(result["domains"].items()):
        ks = [r["k"] for r in d["sweep"]]
        color = f"C{i}"
        ax.plot(ks, [r["emitted_per_pass"] for r in d["sweep"]], "o-", color=color, label=f"{domain}: measured")
        ax.plot(ks, [r["formula_all_passes"] for r in d["sweep"]], "--", color=color, label=f"{domain}: E(a, k)")
        ax.plot(ks, [r["formula_mixed"] for r in d["sweep"]], ":", color=color, label=f"{domain}: (1-r) + r E(a, k)")
    ax.set_xlabel("k (draft tokens per pass)")
    ax.set_ylabel("tokens emitted per target pass")
    ax.set_title(f"n-gram proposer on {result['model'].split(' ')[0]}, greedy")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max_tokens", type=int, default=128)
    ap.add_argument("--prompt_chars", type=int, default=1500)
    ap.add_argument("--max_n", type=int, default=4)
    ap.add_argument("--min_n", type=int, default=1)
    ap.add_argument("--max_k", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/spec_acceptance_ngram_smollm2.json")
    ap.add_argument("--plot_only", action="store_true", help="redraw the PNG from an existing --out JSON")
    args = ap.parse_args()
    png = os.path.splitext(args.out)[0] + ".png"
    if args.plot_only:
        plot(json.load(open(args.out)), png)
        return

    from serving import LLM

    t0 = time.perf_counter()
    llm = LLM(max_model_len=2048)
    load_s = time.perf_counter() - t0
    proposer = NgramProposer(max_n=args.max_n, min_n=args.min_n)
    prompts = build_prompts(args.prompt_chars)
    flat = [(d, p, chat) for d, ps in prompts.items() for p, chat in ps]
    ids = [llm.encode_prompt(p, chat) for _, p, chat in flat]
    t1 = time.perf_counter()
    outs = llm.generate(ids, max_tokens=args.max_tokens, temperature=0)  # one batch: all domains together
    gen_s = time.perf_counter() - t1
    print(f"generated {sum(len(o.token_ids) for o in outs)} tokens for {len(outs)} prompts in {gen_s:.1f} s")
    domains = {}
    for domain in prompts:
        idx = [i for i, (d, _, _) in enumerate(flat) if d == domain]
        generated = [list(outs[i].token_ids) for i in idx]
        rows = sweep(proposer, [ids[i] for i in idx], generated, range(1, args.max_k + 1))
        domains[domain] = dict(
            prompt_tokens=[len(ids[i]) for i in idx],
            generated_tokens=[len(g) for g in generated],
            sample_output=outs[idx[0]].text[:300],
            repetition=repetition([ids[i] for i in idx], generated),
            sweep=rows,
        )
        print(f"{domain}: {sum(len(g) for g in generated)} tokens; 8-grams {domains[domain]['repetition']}")
        for r in rows:
            print(
                f"  k={r['k']}  a={r['acceptance']:.3f}  draft_rate={r['draft_rate']:.2f}  "
                f"emitted/pass={r['emitted_per_pass']:.2f}  formula={r['formula_all_passes']:.2f}  "
                f"mixed={r['formula_mixed']:.2f}"
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(
        benchmark="spec_acceptance",
        proposer=dict(name="ngram", max_n=args.max_n, min_n=args.min_n),
        model="SmolLM2-135M-Instruct (default GGUF, float32)",
        max_tokens=args.max_tokens,
        prompt_chars=args.prompt_chars,
        device=f"CPU ({platform.processor() or platform.machine()}), jax CPU",
        commit=commit,
        date=time.strftime("%Y-%m-%d"),
        load_s=load_s,
        generate_s=gen_s,
        domains=domains,
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
