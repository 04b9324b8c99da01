"""benchmarks/matmul_rows.py and benchmarks/paged_decode_sweep.py end to end on a CPU (--smoke): every case they
promise is in the JSON, timed, and (the sweep) agrees with the kernel's reference."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import matmul_rows, paged_decode_sweep


def _run(monkeypatch, module, *argv):
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()


def test_matmul_rows_smoke(monkeypatch, tmp_path):
    out = tmp_path / "rows.json"
    _run(
        monkeypatch,
        matmul_rows,
        "--smoke",
        "--rows",
        "1,3",
        "--paths",
        "bf16,engine,legacy,xla_fp8,stream,kernel,gemv_sweep,kernel_sweep",
        "--out",
        str(out),
    )
    cases = json.loads(out.read_text())["cases"]
    # The GPU-only paths (stream, kernel) are left out on a CPU, and the fp8 dot for the integer formats; every other
    # (format, rows, path) is timed once.
    got = {(c["fmt"], c["rows"], c["path"]) for c in cases}
    paths = lambda f: ("engine", "legacy") + (("xla_fp8",) if "fp8" in f else ())  # noqa: E731
    want = {(f, r, p) for f in matmul_rows.FORMATS for r in (1, 3) for p in paths(f)}
    want |= {(matmul_rows.FORMATS[0], r, "bf16") for r in (1, 3)}  # the bf16 dot once per shape and row count
    assert got == want and len(cases) == len(want)
    assert all(c["us"] > 0 and "error" not in c for c in cases)


def test_paged_decode_sweep_smoke(monkeypatch, tmp_path):
    out = tmp_path / "sweep.json"
    _run(monkeypatch, paged_decode_sweep, "--smoke", "--page_dtypes", "int8,fp8", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["pages"], r["config"]) for r in rows] == [
        (d, str(c)) for d in ("int8", "fp8") for c in paged_decode_sweep.CONFIGS[:2]
    ]
    assert all(r["rel_err"] < 2e-2 and r["us"] > 0 for r in rows)


def test_paged_decode_sweep_page_bytes():
    # codes plus one float32 scale per token per head for 1-byte pages; K and V
    assert paged_decode_sweep.page_bytes(2, 10, paged_decode_sweep.PAGE_DTYPES["int8"]) == 2 * 2 * 10 * 8 * (128 + 4)
    assert paged_decode_sweep.page_bytes(2, 10, paged_decode_sweep.PAGE_DTYPES["bf16"]) == 2 * 2 * 10 * 8 * 256


@pytest.mark.parametrize(
    "module,argv",
    [
        (matmul_rows, ["--formats", "fp8,nf4"]),
        (matmul_rows, ["--paths", "engine,cublas"]),
        (paged_decode_sweep, ["--page_dtypes", "int8,int4"]),
    ],
)
def test_unknown_choices_are_refused(module, argv, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _run(monkeypatch, module, "--smoke", *argv)
    assert "unknown" in capsys.readouterr().err


def test_pad_sampling_host_smoke(monkeypatch, capsys):
    from benchmarks import pad_sampling_host  # noqa: PLC0415

    _run(monkeypatch, pad_sampling_host, "--number", "3", "--reps", "1")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("pad_sampling_host")]
    assert len(lines) == 4 and all(ln.endswith(" us") for ln in lines)
