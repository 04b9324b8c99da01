"""Writes README.md's supported-models table from the architecture registry (checkpoints/architectures.py).

    PYTHONPATH=. python tools/gen_supported_models.py          # rewrite the region between the markers
    PYTHONPATH=. python tools/gen_supported_models.py --check  # exit 1 when README.md differs from the registry

Only the text between `<!-- supported-models:begin -->` and `<!-- supported-models:end -->` is touched.
"""

from __future__ import annotations

import argparse
import os
import sys

from checkpoints.architectures import with_table

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when README.md is stale")
    parser.add_argument("--readme", default=README)
    args = parser.parse_args()
    with open(args.readme, encoding="utf-8") as f:
        text = f.read()
    new = with_table(text)
    if args.check:
        if new != text:
            print(f"{args.readme}: the supported-models table differs from the registry; run {sys.argv[0]}")
            return 1
        return 0
    if new != text:
        with open(args.readme, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
