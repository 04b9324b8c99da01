"""benchmarks/engine_host_phases.py end to end on the tiny preset (CPU): one row per (batch, mode), every phase
timed where its path runs, and the same greedy tokens counted in each mode's window."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_host_phases


def test_rows_per_batch_and_mode(tmp_path):
    out = tmp_path / "phases.jsonl"
    argv = ["--preset", "tiny", "--dtype", "float32", "--batches", "2", "--modes", "sync1,async1"]
    engine_host_phases.main(argv + ["--input_len", "8", "--output_len", "8", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch"], r["mode"]) for r in rows] == [(2, "sync1"), (2, "async1")]
    sync, chained = (r["phases_ms"] for r in rows)
    assert set(sync) == set(engine_host_phases.PHASES)
    assert sync["forward"] > 0 and sync["sample"] > 0 and sync["launch"] == sync["wait"] == 0  # host-sampled steps
    assert chained["launch"] > 0 and chained["forward"] == chained["sample"] == 0  # one-step loops, chained
    assert all(r["steps"] > 0 and r["tokens"] == 2 * r["steps"] and r["host_ms"] > 0 for r in rows)


def test_rows_per_attention_backend_at_fewer_layers(tmp_path):
    out = tmp_path / "phases.jsonl"
    argv = ["--preset", "tiny", "--dtype", "float32", "--num_layers", "1", "--batches", "1", "--modes", "async1"]
    argv += ["--attention_backends", "xla,interpret", "--input_len", "8", "--output_len", "8", "--out", str(out)]
    engine_host_phases.main(argv)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["attention_backend"], r["num_layers"]) for r in rows] == [("xla", 1), ("interpret", 1)]
    assert all(r["steps"] > 0 and r["tokens"] == r["steps"] for r in rows)


def test_options_that_would_be_ignored_are_refused(tmp_path, capsys):
    out = str(tmp_path / "phases.jsonl")
    for argv, message in (
        (["--model", "default", "--num_layers", "2"], "--num_layers applies to --preset"),
        (["--preset", "tiny", "--attention_backends", "xla,cudnn"], "['cudnn'] not among"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            engine_host_phases.main(argv + ["--out", out])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
