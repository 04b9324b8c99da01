"""benchmarks/serving_load.py without a server: rate parsing, one row per rate from bench_serving's summary, the
sweep plot, the random-weight server's id tokenizer, and bad settings refused with status 2."""

from __future__ import annotations

import math

import pytest

from benchmarks import serving_load as sl


def _summary(ttft_p50: float) -> dict:
    stats = lambda v: dict(mean=v, p50=v, p90=v, p99=2 * v, max=3 * v)  # noqa: E731
    return dict(
        completed=9, failed=1, planned=10, duration_s=5.0, request_throughput=1.8, output_throughput=120.0,
        total_token_throughput=300.0, tokens_per_chunk=1.0, server=dict(preemptions=2.0),
        ttft_ms=stats(ttft_p50), itl_ms=stats(20.0), tpot_ms=stats(21.0), e2el_ms=stats(900.0),
    )  # fmt: skip


def test_rates_and_rows(tmp_path):
    assert sl.parse_rates("0.5, 2,inf") == [0.5, 2.0, math.inf]
    for bad in ("", "0", "1,-2", "fast"):
        with pytest.raises(ValueError):
            sl.parse_rates(bad)
    row = sl.rate_row(2.0, _summary(40.0))
    assert row["request_rate"] == 2.0 and row["output_throughput"] == 120.0 and row["preemptions"] == 2.0
    assert row["ttft_ms"] == dict(p50=40.0, p99=80.0, mean=40.0) and row["itl_ms"]["p99"] == 40.0
    rows = [row, sl.rate_row(math.inf, _summary(400.0))]
    path = tmp_path / "sweep.png"
    sl.plot(dict(label="test", device="CPU", rows=rows), str(path))
    assert path.stat().st_size > 10_000


def test_ids_tokenizer_and_bad_settings(capsys):
    tok = sl.IdsTokenizer()
    assert tok.encode(tok.decode([5, 17])) == [5, 17]
    with pytest.raises(ValueError, match="token ids"):
        tok.encode("hello")
    assert sl.main(["--rates", "0"]) == 2
    assert sl.main(["--base_url", "http://127.0.0.1:9", "--random_weights", "tiny"]) == 2
    assert sl.main(["--base_url", "http://example.com:80"]) == 2
    assert "error:" in capsys.readouterr().err
