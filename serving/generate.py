"""Offline generation binary.

    python -m serving.generate                                  # built-in prompts, default model
    python -m serving.generate --prompt "Hello" --chat --max_tokens 64
    python -m serving.generate --prompts_file prompts.jsonl     # {"prompt": "..."} or {"messages": [...]}

Prints each completion with its time to first token and decode speed. Over a --prompts_file, a progress bar
on stderr counts finished prompts, tokens and tokens/s (tqdm when it is installed, else one line rewritten in
place). Bad flags and unreadable files end with one clear line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

from serving.progress import Progress

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "GGUF file, HF safetensors dir or Orbax dir (default: SmolLM2-135M-Instruct)")
flags.DEFINE_multi_string("prompt", [], "prompt text (repeatable)")
flags.DEFINE_string("prompts_file", None, 'JSONL file: one {"prompt": str} or {"messages": [...]} per line')
flags.DEFINE_integer("max_tokens", 64, "tokens to generate per prompt", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("top_k", 0, "top-k sampling (0 = off)", lower_bound=0)
flags.DEFINE_integer("seed", None, "sampling seed")
flags.DEFINE_bool("chat", False, "wrap prompts in the model's chat template")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_bool("reference", False, "use the contiguous-cache reference path instead of the paged engine")
flags.DEFINE_bool(
    "warmup",
    True,
    "run the batch once untimed first, so the reported latency and speed exclude "
    "compilation (the compile time is printed separately)",
)

BUILTIN_PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    [{"role": "user", "content": "Write one sentence about the sea."}],  # a chat turn
]


class UsageError(Exception):
    pass


def read_prompts_file(path: str) -> list[str | list[dict]]:
    """Prompts from JSONL: strings, or chat message lists."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i + 1, line) for i, line in enumerate(f) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --prompts_file {path}: {e}") from e
    prompts = []
    for no, line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{no}: not valid JSON ({e.msg})") from e
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            prompts.append(item["messages"])
        else:
            raise UsageError(f'{path}:{no}: expected a string, {{"prompt": str}} or {{"messages": [...]}}')
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def run(argv) -> int:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    prompts: list = list(FLAGS.prompt)
    if FLAGS.prompts_file:
        prompts += read_prompts_file(FLAGS.prompts_file)
    prompts = prompts or list(BUILTIN_PROMPTS)

    from serving.engine.llm import LLM

    llm = LLM(FLAGS.model, dtype=FLAGS.dtype)
    print(f"loaded {llm.config.name} in {llm.load_seconds:.1f}s", file=sys.stderr)
    texts = [llm.tokenizer.apply_chat_template(p) if isinstance(p, list) else p for p in prompts]

    def generate(label: str):
        progress = Progress(label) if FLAGS.prompts_file else None
        try:
            return llm.generate(
                texts,
                max_tokens=FLAGS.max_tokens,
                temperature=FLAGS.temperature,
                top_p=FLAGS.top_p,
                top_k=FLAGS.top_k,
                seed=FLAGS.seed,
                chat=FLAGS.chat and not FLAGS.prompts_file,
                use_reference=FLAGS.reference,
                progress=progress,
            )
        finally:
            if progress is not None:
                progress.close()

    if FLAGS.warmup:
        t0 = time.perf_counter()
        generate("warm-up")
        print(f"warm-up run (compiles this batch's shapes): {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    t0 = time.perf_counter()
    outs = generate("")
    wall = time.perf_counter() - t0
    total = 0
    for prompt, out in zip(texts, outs):
        total += len(out.token_ids)
        m = out.metrics
        print("=" * 80)
        print(f"prompt: {prompt!r}")
        print(f"completion ({len(out.token_ids)} tokens, {out.finish_reason}): {out.text}")
        if "ttft_s" in m:
            print(
                f"time to first token {m['ttft_s'] * 1000:.0f} ms, decode {m.get('decode_tokens_per_s', 0):.1f} tok/s"
            )
    print("=" * 80)
    print(f"{len(outs)} prompts, {total} tokens in {wall:.2f}s: {total / wall:.1f} tokens/s overall")
    return 0


def main(argv):
    try:
        return run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def entry():
    try:
        app.run(main)
    except flags.Error as e:  # absl raises before main() for unknown/invalid flags.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()
