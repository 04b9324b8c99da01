"""Two CPU measurements behind server defences (serving/api/http.py, checkpoints/tokenizer.py), printed as JSON.

    python tools/server_probe.py --measure rss [--notrim]   # RSS after refused 12 MiB prompts, model-free server
    python tools/server_probe.py --measure gil              # does tokenizers' encode / encode_batch hold the GIL?

rss: a server over tests/fake_serving.py in this process (the client's 12 MiB body lives here too); six 12 MiB
prompts, refused by the context check (or with 413 under a smaller --max_body_bytes), RSS read 0.5 s after each.
With --notrim the gc + malloc_trim after large bodies is disabled.
gil: a toy WordLevel tokenizer encodes 400K characters while another thread ticks every millisecond; ticks seen
during the call say whether the GIL was released.
"""

from __future__ import annotations

import json
import os
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("measure", "rss", ["rss", "gil"], "what to measure")
flags.DEFINE_bool("trim", True, "rss: keep the heap trim after large bodies")
flags.DEFINE_integer("max_body_bytes", 16 << 20, "rss: the server's body cap (below 12 MiB: the prompts get 413)")


def measure_rss() -> dict:
    import httpx
    import psutil

    from serving.api import http as server_http

    if not FLAGS.trim:
        server_http.trim_heap = lambda: False
    import tests.test_server_hostile as t

    proc = psutil.Process(os.getpid())
    with t.serve(max_body_bytes=FLAGS.max_body_bytes) as s:
        body = json.dumps(t._completion(prompt="x" * (12 << 20))).encode()
        start = proc.memory_info().rss >> 20
        seen = []
        for _ in range(6):
            httpx.post(s.url + "/v1/completions", content=body, timeout=60)
            time.sleep(0.5)
            seen.append(proc.memory_info().rss >> 20)
    return {
        "trim": FLAGS.trim,
        "max_body_bytes": FLAGS.max_body_bytes,
        "rss_start_mib": start,
        "rss_after_each_mib": seen,
    }


def _spin(ticks: list, stop: threading.Event) -> None:
    while not stop.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)


def measure_gil() -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = "a b " * 100_000
    out = {}
    for name, fn in (("encode", lambda: tok.encode(text)), ("encode_batch", lambda: tok.encode_batch([text]))):
        ticks, stop = [], threading.Event()
        th = threading.Thread(target=_spin, args=(ticks, stop))
        th.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        stop.set()
        th.join()
        out[name] = {"seconds": round(t1 - t0, 2), "other_thread_ticks": sum(t0 <= t <= t1 for t in ticks)}
    return out


def main(argv) -> None:
    del argv
    print(json.dumps(measure_rss() if FLAGS.measure == "rss" else measure_gil()))


if __name__ == "__main__":
    app.run(main)
