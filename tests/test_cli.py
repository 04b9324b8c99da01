"""The `pallas-serve` command and the binaries' --help: every engine option listed, exit status 0 (subprocesses
that parse flags and exit before anything imports JAX's device code or loads a model)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from serving.cli import COMMANDS, resolve

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
ENGINE_OPTIONS = ("--model", "--max_num_seqs", "--quantization", "--tensor_parallel_size", "--speculative_method")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    "args",
    [
        ("-m", "serving.generate", "--help"),
        ("-m", "serving.cli", "serve", "--help"),
        ("-m", "serving.cli", "bench", "-?"),
    ],
    ids=["generate", "cli-serve", "cli-bench"],
)
def test_help_lists_the_engine_options_and_exits_0(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    for option in ENGINE_OPTIONS:
        assert f"  {option}:" in r.stdout, (option, r.stdout[-2000:])


def test_help_lists_the_binarys_own_flags():
    r = _run("-m", "serving.cli", "serve", "--help")
    assert "  --port:" in r.stdout and "  --api_key:" in r.stdout
    r = _run("-m", "serving.cli", "convert", "--help")
    assert r.returncode == 0, r.stderr
    assert "  --src:" in r.stdout and "  --quantize:" in r.stdout
    assert "--max_num_seqs" not in r.stdout  # convert takes no engine options


def test_usage_and_unknown_command():
    r = _run("-m", "serving.cli")
    assert r.returncode == 0 and all(name in r.stdout for name in COMMANDS)
    r = _run("-m", "serving.cli", "serv")
    assert r.returncode == 2 and "unknown command 'serv'" in r.stderr


def test_unknown_flag_is_a_one_line_error():
    r = _run("-m", "serving.cli", "generate", "--no_such_flag=1")
    assert r.returncode != 0 and "no_such_flag" in r.stderr and "Traceback" not in r.stderr


def test_resolve_maps_a_leading_model_path():
    assert resolve("serve", ["m.gguf", "--port", "9000"]) == ("serving.server", ["--model=m.gguf", "--port", "9000"])
    assert resolve("generate", ["--prompt", "x"]) == ("serving.generate", ["--prompt", "x"])
    assert resolve("convert", ["--src", "a"]) == ("checkpoints.convert", ["--src", "a"])
    with pytest.raises(ValueError, match="unknown command"):
        resolve("vllm", [])


def test_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["pallas-serve"] == "serving.cli:main"
    packages = project["tool"]["setuptools"]["packages"]
    assert {module.split(".")[0] for module, _ in COMMANDS.values()} <= set(packages)
