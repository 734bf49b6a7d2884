"""The layer suite's decode loops with their command buffers submitted in batches of N (1, 4, 32),
to tell whether a submission per layer costs the GPU time (H200 data:
docs/benchmarks-data/h200-submit-batches-2026-12-02.txt; it did not: batches were no faster).

Usage: ``python scripts/experiment_submit_batches.py [wgpu] [dawn]``. The queue's ``submit`` is
wrapped for the timed loops only (device arrays: no write between the layers), three rounds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _layer_inputs import decode_calls, on_device, run_decode

from paged_sparse_attn import registry


def run(name: str, lw, prob, iqs, ik, res: dict) -> None:
    d = on_device(registry.get_backend(name), lw, prob, iqs, ik)
    be, plan = d.be, d.plan
    queue = be.device_context.device.queue
    orig = queue.submit
    pending: list = []
    calls = decode_calls(d)

    def flush() -> None:
        if pending:
            orig(list(pending))
            pending.clear()

    for rnd in range(3):
        for n in (1, 4, 32):
            def submit(cbs, n=n):
                pending.extend(cbs)
                if len(pending) >= n:
                    flush()

            for what, call in calls.items():
                per = []
                for rep in range(6):
                    queue.submit = submit
                    t0 = time.perf_counter()
                    for i in range(32):
                        call(i)
                    t1 = time.perf_counter()
                    queue.submit = orig
                    flush()
                    be.synchronize()
                    if rep:
                        per.append(((time.perf_counter() - t0) / 32, (t1 - t0) / 32))
                p = np.median(np.array(per), axis=0)
                res.setdefault((name, what, n), []).append(p)
                print(f"round {rnd} {name} {what} batch {n}: {p[0] * 1e6:.1f} us/layer, host {p[1] * 1e6:.1f}",
                      flush=True)
    plan.close()


if __name__ == "__main__":
    run_decode(run, sys.argv[1:] or ["wgpu", "dawn"])
