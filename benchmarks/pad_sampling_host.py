"""Host cost of padding a step's sampling tensors to its row bucket (model/sampling.py pad_sampling), beside the
np.pad rule it replaced: microseconds a call, median of --reps timeit batches.

    PYTHONPATH=. python benchmarks/pad_sampling_host.py
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import jax
import numpy as np

from model.sampling import SamplingTensors, pad_sampling


def np_pad(st: SamplingTensors, s: int) -> SamplingTensors:
    """The replaced rule: np.pad of every field."""
    return jax.tree.map(lambda a: np.pad(np.asarray(a), (0, s - len(a))), st)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--number", type=int, default=2000, help="calls per timed batch")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    for rows, bucket in ((1, 8), (200, 256)):
        st = SamplingTensors.from_rows([dict(temperature=0.7, top_k=5)] * rows)
        for name, fn in (("np.pad", np_pad), ("pad_sampling", pad_sampling)):
            times = timeit.repeat(lambda f=fn, st=st, s=bucket: f(st, s), number=a.number, repeat=a.reps)
            print(
                f"pad_sampling_host rows {rows:3d} -> {bucket:3d} {name:12s} {statistics.median(times) / a.number * 1e6:7.1f} us"
            )


if __name__ == "__main__":
    main()
