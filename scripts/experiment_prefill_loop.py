"""Experiment: what a pipelined loop of prefill attention layers spends beyond its GPU work.

Not a check. The bench's prefill layer workload (B = 1, L = 32k, the last 4096 queries, causal,
top-16 of 128-token blocks, float16 caches, device arrays, a synchronisation per loop) timed as
``AttentionPlan.run`` loops of 8 and 32 layers (wall and host time per layer, median of the
rounds), with one layer per submission and with four, with the device's first layer submitted at
once (as the backend does after a wait) or held for the batch (as before), and with every
layer's result kept (a new result buffer per layer) or dropped (the buffers recycled). The GPU
time of one layer (inversion, partials and combine; timestamps, a backend with ``timestamps=True``)
is what a loop could reach per layer; a loop's time above it is what the host and the
submissions add.

    python scripts/experiment_prefill_loop.py [--backend dawn] [--rounds 4] [--shape TQ L]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li

from paged_sparse_attn import registry


def loop(d, layers: int, keep: bool, hold_first: bool) -> tuple[float, float]:
    """Wall and host seconds per layer of one loop of ``layers`` calls, then a synchronisation."""
    be = d.be
    be.synchronize()
    if hold_first:
        be.device_context.queue_idle = False  # (the batch rule before the idle device's rule)
    kept = []
    t0 = time.perf_counter()
    for i in range(layers):
        r = d.plan.run(d.q[i % len(d.q)], d.k, d.v, d.sel)
        if keep:
            kept.append(r)
    t1 = time.perf_counter()
    be.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) / layers, (t1 - t0) / layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--rounds", type=int, default=4)
    li.add_shape_argument(ap)
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs("prefill", a.shape)
    cls = type(registry.get_backend(a.backend))
    # the GPU time of one layer, timestamps
    be = cls(timestamps=True)
    d = li.on_device(be, lw, prob, layers=2)
    gpu = []
    for i in range(6):
        d.plan.run(d.q[i % 2].numpy(), d.k, d.v, prob["selected"])
        t = be.last_timings
        if i:
            gpu.append((t.get("gpu_invert_s", np.nan), t.get("gpu_attention_s", np.nan)))
    inv, att = np.median(np.array(gpu), axis=0)
    print(f"GPU per layer (timestamps): inversion {inv * 1e3:.3f} ms, partials and combine {att * 1e3:.3f} ms, "
          f"both {(inv + att) * 1e3:.3f} ms", flush=True)
    be.close()
    for lps in (4, 1):
        be = cls(layers_per_submission=lps)
        d = li.on_device(be, lw, prob, layers=8)
        cases = [(8, False, False), (8, False, True), (32, False, False), (8, True, False)]
        if lps == 1:
            cases = [(8, False, False), (32, False, False)]
        res: dict = {c: [] for c in cases}
        for rnd in range(a.rounds + 1):
            for c in cases:
                w, h = loop(d, *c)
                if rnd:
                    res[c].append((w, h))
        for (layers, keep, hold), v in res.items():
            w, h = np.median(np.array(v), axis=0)
            label = (f"{layers} layers, {lps} per submission, results {'kept' if keep else 'dropped'}, first layer "
                     f"{'held for the batch' if hold else 'at once'}")
            print(f"{label:90s} {w * 1e3:7.3f} ms per layer (host {h * 1e3:6.3f}; "
                  f"above the GPU time {(w - inv - att) * 1e3:6.3f})", flush=True)
        be.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
