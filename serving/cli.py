"""The `pallas-serve` command: one entry point over the project's binaries (as `vllm serve MODEL` is for vLLM).

    pallas-serve serve [MODEL] [--port 8000] [engine flags]     # python -m serving.server
    pallas-serve generate [MODEL] --prompt "Hello" --chat       # python -m serving.generate
    pallas-serve convert --src model.gguf --dst orbax_dir/      # python -m checkpoints.convert
    pallas-serve bench [MODEL] --mode serving                   # python -m benchmarks.bench
    pallas-serve train-heads --out heads_dir/                   # python -m serving.train_heads

Each command runs its binary's module as `__main__` with the remaining arguments, so the two spellings behave
alike; a leading argument that is not a flag names the model (`--model`) for serve, generate and bench.
`pallas-serve COMMAND --help` lists the binary's flags and, for serve, generate and bench, every engine option,
and exits 0 (absl's own --help lists only the main module's flags and exits 1; `install_help_flag` replaces it).
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence

from absl import app, flags

COMMANDS = {
    "serve": ("serving.server", "OpenAI-compatible HTTP server"),
    "generate": ("serving.generate", "offline generation for prompts or a JSONL file"),
    "convert": ("checkpoints.convert", "GGUF / HF safetensors -> Orbax checkpoint (optionally quantised)"),
    "bench": ("benchmarks.bench", "serving, latency and prefix-cache benchmarks"),
    "train-heads": ("serving.train_heads", "train Medusa draft heads for speculative decoding"),
}
TAKES_MODEL = ("serve", "generate", "bench")


class _HelpFlag(flags.BooleanFlag):
    """--help, --helpshort and -?: the binary's flags and those of `modules`, then exit status 0."""

    def __init__(self, name: str, short_name: str | None, modules: tuple[str, ...]):
        super().__init__(
            name, False, "show this help: the binary's flags and the engine options", short_name=short_name
        )
        self.allow_override = True  # replaces absl's own help flag, and a later install replaces this one
        self._modules = modules

    def parse(self, argument):
        if self._parse(argument):
            print(usage_text(self._modules))
            sys.exit(0)


def usage_text(modules: Sequence[str] = ()) -> str:
    """The main module's docstring, its flags, then the flags defined in each of `modules`."""
    main = sys.modules.get("__main__")
    parts = [(getattr(main, "__doc__", None) or "").strip()]
    parts.append(flags.FLAGS.main_module_help())
    parts += [flags.FLAGS.module_help(m) for m in modules]
    parts.append("Try --helpfull to list absl's own flags as well.")
    return "\n\n".join(p for p in parts if p)


def install_help_flag(modules: Sequence[str] = ()) -> None:
    """Makes --help list the main module's flags and those defined in `modules`, and exit 0.

    Idempotent; the last call wins (serving/flags.py installs it with the engine options at import).
    """
    app.define_help_flags()  # absl's own help flags first, so that app.run does not define them again over ours
    for name, short in (("help", "?"), ("helpshort", None)):
        flags.DEFINE_flag(_HelpFlag(name, short, tuple(modules)))


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: pallas-serve COMMAND [ARGS...]   (pallas-serve COMMAND --help lists its flags)", ""]
    lines += [f"  {name:<{width}}  {doc}  (python -m {module})" for name, (module, doc) in COMMANDS.items()]
    return "\n".join(lines)


def resolve(command: str, args: Sequence[str]) -> tuple[str, list[str]]:
    """The module that runs `command` and its arguments (a leading model path becomes `--model=PATH`).

    Raises:
        ValueError: an unknown command.
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    args = list(args)
    if command in TAKES_MODEL and args and not args[0].startswith("-"):
        args = [f"--model={args[0]}", *args[1:]]
    return COMMANDS[command][0], args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `pallas-serve COMMAND ARGS...`; returns the exit status of a usage error (the binaries exit themselves)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    try:
        module, binary_args = resolve(args[0], args[1:])
    except ValueError as e:
        print(f"pallas-serve: {e}\n\n{_usage()}", file=sys.stderr)
        return 2
    install_help_flag()
    sys.argv = [f"pallas-serve {args[0]}", *binary_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
