"""Converts a GGUF file or an HF safetensors directory into an Orbax checkpoint (checkpoints/orbax_io.py).

    python -m checkpoints.convert --src model.gguf --dst /ckpt/model [--dtype bfloat16] [--overwrite]
        [--mesh tp=4,pp=2] [--quantize int4_awq --calibration_file text.txt]

Read every tensor (progress on stderr: "reading i/n") -> cast each to --dtype ("casting") -> quantise or shard
when asked -> Orbax save with config.json and the tokenizer files ("saving n tensors ... to DST", then "saved"). Errors in flags or paths print one `convert: error: ...` line and exit 1.

--mesh writes the checkpoint sharded for that mesh (degrees dp/tp/pp/ep of sharding/config.py; the first
tp * pp * ... devices of this host, e.g. CPU devices from --xla_force_host_platform_device_count): each tensor
goes from the host straight into its NamedSharding of sharding/rules.py, one tensor at a time, and Orbax writes
every shard from the device that holds it. `orbax_io.restore(dst, mesh=other)` reshards on read: each device
reads only the byte ranges of its own shards, so a checkpoint saved at tp=4 restores at tp=2 (or on one device)
without the model ever existing whole on one device. The pipeline axis splits nothing yet (layers replicated).

--quantize FORMAT (model/quant_formats.py QUANTIZATIONS) quantises every linear projection as
`LLM(quantization=...)` does at load (model/quantize_model.py; calibrated methods read --calibration_file: a .txt,
a JSONL with a "text" field per line or a directory of them; default the text of model/calibration/) and
stores the QuantizedArrays (orbax_io: quantization.json + their arrays), so loading the result re-quantises nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from checkpoints import hf, orbax_io
from checkpoints.loader import load_checkpoint


def _quantize(config, params, tokenizer, method: str, calibration_file: str | None, dtype) -> dict:
    """The params with every linear projection a QuantizedArray of `method` (model/quantize_model.py)."""
    from model.quant import QuantizedArray
    from model.quantize_model import quantize_model
    from model.transformer import build_model, model_params

    model = build_model(config, params, jnp.float32 if dtype is None else dtype)
    names = quantize_model(model, method, tokenizer, calibration_file=calibration_file)
    sys.stderr.write(f"quantised {len(names)} projections to {method}\n")
    return {k: v if isinstance(v, QuantizedArray) else np.asarray(v) for k, v in model_params(model).items()}


def parse_mesh(spec: str):
    """'tp=4,pp=2' -> ParallelConfig(tp=4, pp=2); a ValueError names the bad part."""
    from sharding.config import ParallelConfig

    degrees = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key not in ("dp", "tp", "pp", "ep") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh: {part!r} is not <dp|tp|pp|ep>=<integer >= 1> (e.g. --mesh tp=4,pp=2)")
        if key in degrees:
            raise ValueError(f"--mesh: {key} given twice")
        degrees[key] = int(value)
    return ParallelConfig(**degrees)


def _shard(config, params: dict, mesh_spec: str) -> dict:
    """Each host array put into its NamedSharding on the --mesh mesh, one at a time (the host copy is dropped)."""
    import jax

    from sharding.mesh import make_mesh
    from sharding.rules import param_shardings

    parallel = parse_mesh(mesh_spec)
    if parallel.num_devices > jax.device_count():
        raise ValueError(f"--mesh {mesh_spec} needs {parallel.num_devices} devices; {jax.device_count()} exist")
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.num_devices])
    shardings = param_shardings({k: np.shape(v) for k, v in params.items()}, mesh, head_dim=config.head_dim)
    progress = Progress(f"sharding for {mesh_spec}")
    for i, name in enumerate(list(params)):
        params[name] = jax.device_put(params[name], shardings[name])
        progress(i + 1, len(params), name)
    return params


class Progress:
    """`progress(done, total, name)` callback: one rewritten line on a terminal, a line per 10% in a log."""

    def __init__(self, label: str, stream=sys.stderr):
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.last_decile = -1

    def __call__(self, done: int, total: int, name: str) -> None:
        pct = 100 * done // max(total, 1)
        if self.tty:
            end = "\n" if done == total else ""
            self.stream.write(f"\r\033[K{self.label} {done}/{total} ({pct}%) {name}{end}")
        elif pct // 10 != self.last_decile or done == total:
            self.last_decile = pct // 10
            self.stream.write(f"{self.label} {done}/{total} ({pct}%) {name}\n")
        self.stream.flush()


def _load(src: str, dtype: Any) -> tuple[Any, dict[str, np.ndarray], Any]:
    """(config, params, tokenizer) from any supported source, every tensor read once, here, with its progress line
    (a loader's params read lazily: left so, saving would read them, under a progress line that says "loading").
    HF tensors are cast while they are read."""
    if os.path.isdir(src) and hf.is_hf_dir(src):
        config, params = hf.load_hf(src, dtype=dtype, progress=Progress("reading"))
        return config, params, hf.load_hf_tokenizer(src)
    checkpoint = load_checkpoint(src)
    lazy, progress = checkpoint.params, Progress("reading")
    params = {}
    for i, name in enumerate(list(lazy)):
        params[name] = lazy[name]
        progress(i + 1, len(lazy), name)
    return checkpoint.config, params, checkpoint.tokenizer


def convert(
    src: str,
    dst: str,
    dtype: str = "auto",
    overwrite: bool = False,
    mesh: str | None = None,
    quantize: str | None = None,
    calibration_file: str | None = None,
) -> None:
    """Loads `src` and writes an Orbax checkpoint with config and tokenizer at `dst` (sharded for `mesh`, e.g.
    "tp=4,pp=2", when given; weights quantised by `quantize`, e.g. "int4_awq", when given).

    Raises:
        FileNotFoundError, FileExistsError, ValueError: bad source or destination (messages name the path).
    """
    # Checked before loading, which can take minutes; orbax_io.save enforces the same rules.
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        if not overwrite:
            raise FileExistsError(f"{dst} already exists (pass --overwrite to replace it)")
        if not orbax_io.is_orbax_dir(dst):
            raise FileExistsError(f"{dst} exists and is not an Orbax checkpoint; refusing to overwrite it")
    cast = None if dtype == "auto" else jnp.dtype(dtype)
    if mesh is not None:
        parse_mesh(mesh)  # a bad --mesh fails before the (long) load
    _check_quantize(quantize, calibration_file, mesh)
    config, params, tokenizer = _load(src, cast)
    if cast is not None:
        progress = Progress(f"casting to {dtype}")
        for i, name in enumerate(list(params)):
            params[name] = np.asarray(params[name]).astype(cast, copy=False)  # One tensor at a time: peak memory.
            progress(i + 1, len(params), name)
    if quantize is not None:
        params = _quantize(config, params, tokenizer, quantize, calibration_file, cast)
    if mesh is not None:
        params = _shard(config, params, mesh)
    size_gb = sum(p.nbytes for p in params.values()) / 1e9
    sys.stderr.write(f"saving {len(params)} tensors ({size_gb:.2f} GB) of {config.name} to {dst} ...\n")
    start = time.perf_counter()
    orbax_io.save(dst, config, params, tokenizer, overwrite=overwrite)
    sys.stderr.write(
        f"saved in {time.perf_counter() - start:.1f} s"
        f"{'' if tokenizer is not None else ' (no tokenizer found in the source)'}\n"
    )


def _check_quantize(quantize: str | None, calibration_file: str | None, mesh: str | None) -> None:
    from model.quant_formats import CALIBRATED_QUANTIZATIONS, QUANTIZATIONS

    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}; got {quantize!r}")
    if calibration_file is not None and quantize is None:
        raise ValueError("--calibration_file needs --quantize")
    if calibration_file is not None and quantize not in CALIBRATED_QUANTIZATIONS:
        raise ValueError(f"--calibration_file is for --quantize {', '.join(CALIBRATED_QUANTIZATIONS)}, not {quantize}")
    if calibration_file is not None and not os.path.exists(calibration_file):
        raise ValueError(f"--calibration_file {calibration_file!r} does not exist")
    if quantize is not None and mesh is not None:
        raise ValueError("--quantize with --mesh is not supported yet (quantised weights are stored unsharded)")


def define_flags() -> None:
    """The binary's flags, defined only when it runs as one (importing convert for its functions, as tests and
    other tools do, must not clash with the engine flags of serving/flags.py such as --dtype)."""
    flags.DEFINE_string("src", None, "a .gguf file, an HF safetensors directory, an Orbax checkpoint or 'default'")
    flags.DEFINE_string("dst", None, "output directory for the Orbax checkpoint")
    flags.DEFINE_enum(
        "dtype",
        "auto",
        ["auto", "float32", "bfloat16"],
        "parameter dtype to store; auto keeps the loaded one (float32 for GGUF, stored for HF)",
    )
    flags.DEFINE_bool("overwrite", False, "replace an existing Orbax checkpoint at --dst")
    flags.DEFINE_string("mesh", None, "shard the saved arrays for this mesh, e.g. tp=4,pp=2 (dp/tp/pp/ep)")
    flags.DEFINE_string("quantize", None, "store quantised weights: int8, fp8, w8a8_*, int4_rtn/awq/gptq")
    flags.DEFINE_string("calibration_file", None, "calibration text for --quantize (default: built in)")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        sys.stderr.write(f"convert: error: unexpected arguments {argv[1:]}\n")
        return 2
    f = flags.FLAGS
    if not f.src or not f.dst:
        sys.stderr.write("convert: error: --src and --dst are required\n")
        return 2
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # Orbax and JAX log every step at INFO; keep stderr to progress.
    try:
        convert(f.src, f.dst, f.dtype, f.overwrite, f.mesh, f.quantize, f.calibration_file)
    except (OSError, ValueError, RuntimeError) as e:  # Expected user errors: one line, no traceback.
        sys.stderr.write(f"convert: error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
