"""Kernels per decoder layer of the engine's decode step, with the W8A8 input quantisers fused and not.

    PYTHONPATH=. python benchmarks/kernel_counts.py --preset llama3_8b --quantization w8a8_fp8_rtn --batch 64
    ... --source hlo,trace      (on a GPU: the compiled step's HLO and a profiler trace of it)
    PYTHONPATH=. python benchmarks/kernel_counts.py --preset llama3_8b --vocab_size 512 --batch 64
        (a CPU: the step lowered for CUDA; the small vocabulary keeps the host's memory low)

Per layer = count(L + 1 layers) - count(L layers) (random weights at the preset's shape), so the embedding, the
head and sampling drop out. For each MatmulOptions.fuse_act_quant (off: the unfused ops, then the quantiser; on:
model/quant_fused.py's kernels) and each source:

  hlo     the decode step (the runner's ("step", S, S, W, True, S) executable) compiled on this device; every
          instruction of the optimised module outside fused computations that launches work: `fusion`,
          `custom-call` (Pallas kernels, cuBLAS), and the rest (copies, ...) by opcode. A GPU only: on a CPU the
          fused kernels do not run.
  lowered the same step lowered for CUDA without a GPU (Triton kernels; the device capability faked as sm_90, the
          Mosaic GPU paths off): custom calls (each one kernel) and the XLA ops left between them, before XLA's
          fusion passes merge them (an upper bound on its fusions). Runs on a CPU.
  trace   the step run under jax.profiler: kernel launches on the GPU's streams (perfetto trace) per step.

Prints one line per (fuse_act_quant, source) and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import re
import tempfile

import jax
import jax.numpy as jnp

from model import quant
from model.config import ModelConfig
from model.transformer import random_model

# Instructions of an optimised HLO module that launch nothing: structure, aliases, constants.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id"}
# StableHLO ops that are layout or bookkeeping only (no kernel of their own once XLA has fused).
_LOWERED_FREE = {"constant", "return", "func.return", "reshape", "broadcast_in_dim", "get_tuple_element", "tuple"}


def hlo_counts(text: str) -> collections.Counter:
    """Opcode -> count over the computations of an optimised HLO module that are not fused bodies."""
    counts: collections.Counter = collections.Counter()
    fused = False
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            fused = "fused" in head.group(2) or "wrapped" in head.group(2) or head.group(2).startswith("region")
            continue
        m = re.match(r"^\s+(ROOT )?%?[\w.\-]+ = [^=]*? ([a-z][\w\-]*)\(", line)
        if m and not fused and m.group(2) not in _FREE:
            counts[m.group(2)] += 1
    return counts


def lowered_counts(text: str) -> collections.Counter:
    """Op name -> count in a StableHLO module, each private function's ops counted once per call from @main
    (a jitted kernel wrapper called three times is lowered once); a Pallas kernel is one `custom_call`."""
    funcs: dict[str, tuple[collections.Counter, list[str]]] = {}
    parts = re.split(r"^\s*func\.func (?:public |private )?@([\w$.\-]+)\(", text, flags=re.M)
    for name, body in zip(parts[1::2], parts[2::2]):
        ops: collections.Counter = collections.Counter()
        for m in re.finditer(r"= \"?(stablehlo\.[\w]+)", body):
            op = m.group(1).split(".", 1)[1]
            if op not in _LOWERED_FREE:
                ops[op] += 1
        funcs[name] = (ops, re.findall(r"\bcall @([\w$.\-]+)\(", body))

    def total(name: str) -> collections.Counter:
        ops, callees = funcs.get(name, (collections.Counter(), []))
        out = collections.Counter(ops)
        for callee in callees:
            out.update(total(callee))
        return out

    return total("main")


def _runner(cfg: ModelConfig, args, kv_dtype, fuse: bool, options: dict, attention_backend=None):
    from serving.engine.quantize import quantize_model
    from serving.engine.runner import ModelRunner

    model = random_model(cfg, jnp.bfloat16)
    if args.quantization != "bf16":
        quantize_model(model, args.quantization)
    quant.set_options(model, quant.MatmulOptions(fuse_act_quant=fuse, **options))
    bs, batch = 16, args.batch
    blocks = -(-args.ctx // bs) + 1
    return ModelRunner(
        model, num_blocks=batch * blocks + 1, block_size=bs, max_num_seqs=batch, max_num_batched_tokens=max(256, batch),
        max_model_len=blocks * bs, kv_dtype=kv_dtype, attention_backend=attention_backend,
    )  # fmt: skip


def _decode_entry(runner, batch: int):
    """(build, abstract args) of the runner's decode step at `batch` rows."""
    return next((b, a) for k, b, a in runner.warmup_plan() if k[0] == "step" and k[4] and k[1] == batch)


@contextlib.contextmanager
def _fake_cuda():
    """Lets the Triton lowering run on a CPU host: the default device claims sm_90 (pallas_kernels/backend.py) and
    Pallas' Triton rules get a compute capability."""
    import types

    from jax._src.pallas.triton import pallas_call_registration as registration

    from pallas_kernels import backend

    saved = backend._device_info, registration.gpu_info_lib.get_gpu_info
    backend._device_info = lambda: ("gpu", (9, 0))
    registration.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    try:
        yield
    finally:
        backend._device_info, registration.gpu_info_lib.get_gpu_info = saved


def _trace_counts(runner, batch: int, ctx: int, steps: int = 5) -> collections.Counter:
    """Kernel name -> launches per step, from a profiler trace of `steps` decode steps: the GPU streams' kernel,
    copy and memset events (benchmarks/engine_core.py device_spans)."""
    from benchmarks.engine_core import device_spans
    from serving.engine.runner import RowInput

    blocks = -(-ctx // runner.block_size) + 1
    rows = [RowInput([1], ctx - 1, list(range(1 + i * blocks, 1 + (i + 1) * blocks))) for i in range(batch)]
    jax.block_until_ready(runner.forward(rows))  # compile outside the trace
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for _ in range(steps):
            out = runner.forward(rows)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        _, spans = device_spans(d)
    counts = collections.Counter(re.sub(r"[._]\d+$", "", name) for _, _, name in spans)
    return collections.Counter({k: v / steps for k, v in counts.items()})


def measure(args, fuse: bool, source: str, layers: int) -> collections.Counter:
    from serving.engine.quantize import kv_cache_dtype

    cfg = dataclasses.replace(ModelConfig.preset(args.preset), num_layers=layers)
    cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size) if args.vocab_size else cfg
    kv = kv_cache_dtype(args.kv_cache_dtype, jnp.bfloat16)
    if source == "lowered":
        with _fake_cuda():  # the streaming / W8A8 matmuls are Mosaic GPU kernels: left out of a CPU lowering
            opts = dict(stream_max_rows=0, w8a8_min_rows=1 << 30, act_quant_backend="triton", gemv_max_rows=())
            runner = _runner(cfg, args, kv, fuse, opts, args.attention_backend)
            build, call_args = _decode_entry(runner, args.batch)
            text = build().trace(*call_args).lower(lowering_platforms=("cuda",)).as_text()
        return lowered_counts(text)
    runner = _runner(cfg, args, kv, fuse, {})
    if source == "hlo":
        build, call_args = _decode_entry(runner, args.batch)
        return hlo_counts(build().lower(*call_args).compile().as_text())
    return _trace_counts(runner, args.batch, args.ctx)


def per_layer(args, fuse: bool, source: str) -> dict:
    lo, hi = measure(args, fuse, source, args.layers), measure(args, fuse, source, args.layers + 1)
    diff = {k: hi[k] - lo[k] for k in set(hi) | set(lo) if hi[k] != lo[k]}
    if source == "hlo":
        total = sum(diff.values())
        split = dict(fusion=diff.get("fusion", 0), custom_call=diff.get("custom-call", 0))
        split["other"] = total - sum(split.values())
    elif source == "lowered":
        total = diff.get("custom_call", 0)
        split = dict(custom_call=total, xla_ops=sum(diff.values()) - total)
    else:
        total = sum(diff.values())
        split = {}
    return dict(fuse_act_quant=fuse, source=source, per_layer=total, split=split, by_op=dict(sorted(diff.items())))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--quantization", default="w8a8_fp8_rtn")
    p.add_argument("--kv_cache_dtype", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--layers", type=int, default=1, help="L: per layer = count(L + 1) - count(L)")
    p.add_argument("--vocab_size", type=int, default=0, help="a smaller vocabulary (host memory; no per-layer effect)")
    p.add_argument("--source", default="", help="hlo,lowered,trace (default: hlo,trace on a GPU, lowered on a CPU)")
    p.add_argument("--attention_backend", default="triton", help="lowered: the paged attention kernels' backend")
    p.add_argument("--out", default="")
    args = p.parse_args()
    gpu = jax.default_backend() == "gpu"
    sources = args.source.split(",") if args.source else (["hlo", "trace"] if gpu else ["lowered"])
    if not gpu and {"hlo", "trace"} & set(sources):
        raise SystemExit("--source hlo / trace count what runs on a GPU; on a CPU use --source lowered")
    rows = []
    for source in sources:
        for fuse in (False, True):
            r = per_layer(args, fuse, source)
            rows.append(r)
            print(
                f"kernel_counts {args.preset} {args.quantization} batch {args.batch} source={source} "
                f"fuse_act_quant={fuse}: {r['per_layer']:g} per layer {r['split']} {r['by_op']}",
                flush=True,
            )
    if args.out:
        device = str(jax.devices()[0].device_kind)
        with open(args.out, "w") as f:
            json.dump(dict(device=device, args=vars(args), rows=rows), f, indent=1, default=float)


if __name__ == "__main__":
    main()
