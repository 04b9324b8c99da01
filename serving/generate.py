"""Offline generation binary.

    python -m serving.generate                                  # built-in prompts, default model
    python -m serving.generate --prompt "Hello" --chat --max_tokens 64
    python -m serving.generate --prompts_file prompts.jsonl     # {"prompt": "..."} or {"messages": [...]}
    python -m serving.generate --model m.gguf --max_num_seqs 32 --nowarmup_run

The engine flags (--model, --dtype, --max_num_seqs, --block_size, ... : serving/flags.py) are shared with
serving/server.py and benchmarks/bench.py; the flags below say what to generate.

Multi-host: start one process per host with --coordinator_address host:port --num_processes N --process_id i
(the same other flags everywhere); the engine spans every process's devices, process 0 generates and prints.

Prints each completion with its time to first token and decode speed. Over a --prompts_file, a progress bar
on stderr counts finished prompts, tokens and tokens/s (tqdm when it is installed, else one line rewritten in
place). Bad flags and unreadable files end with one clear line on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import sys
import time

from absl import app, flags

from serving import flags as engine_flags
from serving.progress import Progress

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("prompt", [], "prompt text (repeatable)")
flags.DEFINE_string("prompts_file", None, 'JSONL file: one {"prompt": str} or {"messages": [...]} per line')
flags.DEFINE_integer("max_tokens", 64, "tokens to generate per prompt", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("top_k", 0, "top-k sampling (0 = off)", lower_bound=0)
flags.DEFINE_integer("seed", None, "sampling seed (prompt i uses seed + i)")
flags.DEFINE_bool("chat", False, "wrap prompts in the model's chat template")
flags.DEFINE_bool(
    "warmup_run",
    True,
    "run the batch once untimed first, so the reported latency and speed exclude "
    "compilation (the compile time is printed separately)",
)


@dataclasses.dataclass(frozen=True)
class GenerateSettings:
    """What this binary does besides building the engine (the engine flags make an EngineConfig)."""

    prompt: tuple[str, ...] = ()
    prompts_file: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    chat: bool = False
    warmup_run: bool = True

    def sampling(self) -> dict:
        """LLM.generate's sampling arguments (validated there)."""
        return dict(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed
        )


def settings_from_flags() -> GenerateSettings:
    values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(GenerateSettings)}
    return GenerateSettings(**values | {"prompt": tuple(values["prompt"])})


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
    settings = settings_from_flags()
    config = engine_flags.engine_config_from_flags()
    prompts: list = list(settings.prompt)
    if settings.prompts_file:
        prompts += read_prompts_file(settings.prompts_file)
    prompts = prompts or BUILTIN_PROMPTS
    multihost = engine_flags.initialize_multihost_from_flags()  # before anything touches a device

    from serving.engine.llm import LLM
    from sharding import multihost as multihost_lib

    llm = LLM.from_config(config)
    if multihost and not multihost_lib.lead_or_follow(llm.engine):
        return 0  # a follower: it replayed process 0's steps, and process 0 prints
    try:
        return _generate_and_print(llm, settings, prompts)
    finally:
        if multihost:
            multihost_lib.stop_followers(llm.engine)


def _generate_and_print(llm, settings: GenerateSettings, prompts: list) -> int:
    print(f"loaded {llm.name} in {llm.load_seconds:.1f}s", file=sys.stderr)
    if prompts is BUILTIN_PROMPTS and not llm.has_chat_template:
        prompts = [p for p in prompts if not isinstance(p, list)]
        print(f"{llm.name} has no chat template (a base model): the built-in chat prompt is skipped", file=sys.stderr)
    texts = [llm.render_chat(p) if isinstance(p, list) else p for p in prompts]
    chat = settings.chat and not settings.prompts_file
    if chat and not llm.has_chat_template:
        raise UsageError(f"--chat: {llm.name} has no chat template (a base model, not instruction-tuned); drop --chat")
    print(llm.kv_pool_summary(), file=sys.stderr)
    # One seed for both runs: the timed run then replays the warm-up exactly (same tokens, same batch shapes).
    sampling = settings.sampling() | dict(seed=settings.seed if settings.seed is not None else random.getrandbits(31))

    def generate(label: str):
        progress = Progress(label) if settings.prompts_file else None
        try:
            return llm.generate(texts, chat=chat, progress=progress, **sampling)
        finally:
            if progress is not None:
                progress.close()

    compiles = 0
    if settings.warmup_run:
        t0 = time.perf_counter()
        generate("warm-up")
        # The warm-up left its prompts in the prefix cache: cleared, the timed run schedules the same shapes as the
        # warm-up compiled (a prefix hit would take a shape of its own, compiled inside the timed run) and its time
        # to first token is that of a prompt the engine has not seen.
        llm.reset_prefix_cache()
        print(f"warm-up run (compiles this batch's shapes): {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        compiles = num_compiles(llm)
    t0 = time.perf_counter()
    outs = generate("")
    wall = time.perf_counter() - t0
    if settings.warmup_run and num_compiles(llm) > compiles:
        print(f"note: the timed run compiled {num_compiles(llm) - compiles} executables; its times include them",
              file=sys.stderr)  # fmt: skip
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


def num_compiles(llm) -> int:
    """Step executables the engine has made so far (compiled or loaded), over its data-parallel replicas."""
    return sum(e.runner.num_compiles for e in getattr(llm.engine, "replicas", [llm.engine]))


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
    except SystemExit as e:  # main's status, through absl's sys.exit
        if FLAGS.is_parsed() and FLAGS.num_processes > 1:
            raise  # a multi-process job leaves jax.distributed through the interpreter's exit handlers
        exit_now(e.code)


def exit_now(code) -> None:
    """Ends the process without the interpreter's teardown, everything printed and flushed: nothing is left to
    write, and tearing JAX down (its executables, the CPU client) takes seconds on a small host."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))


if __name__ == "__main__":
    entry()
