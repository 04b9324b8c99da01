#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs pallas-serve with its serve/ray/dev extras.
# Python search order: $PYTHON, then python3.13/python3.12/python3/python on PATH, then $PYENV_ROOT/versions/3.1[2-9]*.
set -euo pipefail
cd "$(dirname "$0")/.."

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c
  for c in ${PYTHON:-} python3.13 python3.12 python3 python; do
    if command -v "$c" >/dev/null 2>&1 && ok "$(command -v "$c")"; then command -v "$c"; return 0; fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for c in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -rV); do
    for exe in "$c/bin/python3" "$c/bin/python"; do
      if [ -x "$exe" ] && ok "$exe"; then echo "$exe"; return 0; fi
    done
  done
  return 1
}

if [ -x .venv/bin/python ] && ok .venv/bin/python; then
  PY=.venv/bin/python
else
  if ! BASE=$(find_python); then
    echo "error: pallas-serve needs Python >= 3.12 (jax 0.11.2 requires it), and none was found on PATH" \
         "(python3.13, python3.12, python3, python) or under \$PYENV_ROOT/versions (${PYENV_ROOT:-$HOME/.pyenv}/versions)." \
         "Install Python 3.12+ or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "setup: creating .venv with $BASE ($("$BASE" --version))"
  rm -rf .venv
  "$BASE" -m venv .venv
  PY=.venv/bin/python
fi

STAMP=.venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$STAMP" ]; then
  echo "setup: installing pallas-serve and its dependencies into .venv"
  "$PY" -m pip install -q --upgrade pip >/dev/null
  if ! "$PY" -m pip install -q -e '.[serve,ray,dev]'; then
    echo "error: pip could not install the dependencies (is the package index reachable?)" >&2
    exit 1
  fi
  rm -f .venv/.installed-*
  touch "$STAMP"
fi
