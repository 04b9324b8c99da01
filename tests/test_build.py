"""BUILD covers every Python file and names no missing one."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gen_build  # noqa: E402


def test_build_covers_tree():
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
        assert gen_build.problems(f.read()) == []


def test_check_detects_uncovered_and_missing_files():
    text = gen_build.render()
    assert any("not covered" in p for p in gen_build.problems(text.replace('"model/config.py",', "")))
    bogus = text.replace('"model/config.py",', '"model/config.py",\n        "model/nope.py",')
    assert any("missing file: model/nope.py" in p for p in gen_build.problems(bogus))


def test_check_command_exit_status():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "gen_build.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
