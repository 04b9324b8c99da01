"""benchmarks/engine_core.py's device-timeline reader on a synthetic perfetto trace (the H200 idle figure uses it)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.engine_core import device_timeline


def _write(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_busy_union_and_gaps(tmp_path):
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
    ]
    gpu = [  # [0, 10] and [5, 12] overlap (two streams), then a 8 us gap, then [20, 30], a 70 us gap, [100, 110]
        {"ph": "X", "pid": 2, "tid": 1, "ts": 0.0, "dur": 10.0, "name": "matmul"},
        {"ph": "X", "pid": 2, "tid": 2, "ts": 5.0, "dur": 7.0, "name": "attention"},
        {"ph": "X", "pid": 2, "tid": 1, "ts": 20.0, "dur": 10.0, "name": "sample"},
        {"ph": "X", "pid": 2, "tid": 1, "ts": 100.0, "dur": 10.0, "name": "loop"},
    ]
    host = [{"ph": "X", "pid": 1, "tid": 9, "ts": 0.0, "dur": 500.0, "name": "python"}]
    _write(tmp_path, meta + gpu + host)
    t = device_timeline(str(tmp_path), top=2)
    assert t["device_events"] == 4
    assert t["span_ms"] == pytest.approx(0.110)
    assert t["busy_ms"] == pytest.approx(0.032)  # 12 + 10 + 10 us: the host event is not device time
    assert t["gpu_idle_fraction"] == pytest.approx(1 - 32 / 110)
    assert [g["ms"] for g in t["largest_gaps"]] == [0.07, 0.008]
    assert t["largest_gaps"][0] == dict(ms=0.07, after="sample", before="loop")
    assert t["largest_gaps"][1]["after"] == "attention"  # the event that ended last before the gap


def test_no_device_events(tmp_path):
    _write(tmp_path, [{"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1.0, "name": "python"}])
    assert device_timeline(str(tmp_path))["device_events"] == 0
