"""Experiment: the GPU's SM clock while a loop of decode ``forward()`` calls runs (host arrays in
and out, one call after another), and while a pipelined loop of planned layers runs.

Usage: ``python scripts/experiment_forward_clock.py [--backend dawn] [--seconds 2]``

Samples ``nvidia-smi --query-gpu=timestamp,clocks.sm`` every 10 ms in a subprocess, runs each
loop for ``--seconds`` seconds, and prints the clocks sampled inside each loop's time window
(min, median, share at the top clock) with the loop's median time per call.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li

import paged_sparse_attn as psa
from paged_sparse_attn import registry


def _window(samples, t0, t1):
    return np.array([c for t, c in samples if t0 <= t <= t1], float)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    lw, prob, iqs, ik = li.layer_inputs("decode")
    be = registry.get_backend(a.backend)
    d = li.on_device(be, lw, prob, iqs, ik)
    rng = np.random.default_rng(4)
    qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(32)]
    kw = {"used_kv_lens": prob["used_kv_lens"], "block_size": lw.w.block_size, "causal": lw.w.causal, "backend": be}
    fwd = lambda i: psa.forward(qs[i % 32], d.k, d.v, prob["block_tables"], prob["selected"],
                                prob["cu_seqlens_q"], **kw)
    att = li.decode_calls(d)["attention"]
    for i in range(8):
        fwd(i)
        att(i)
    be.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm", "--format=csv,noheader,nounits",
                            "-lms", "10"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    windows = {}
    for name, call, sync in (("forward() loop", fwd, None), ("pipelined plan.run loop", att, be.synchronize),
                             ("idle", None, None), ("forward() loop again", fwd, None)):
        t0 = time.time()
        n, per = 0, []
        while time.time() - t0 < a.seconds:
            s = time.perf_counter()
            if call is None:
                time.sleep(0.05)
            else:
                for i in range(32 if sync else 1):
                    call(n + i)
                if sync:
                    sync()
            per.append((time.perf_counter() - s) / (32 if sync else 1))
            n += 1
        windows[name] = (t0, time.time(), float(np.median(per)))
    time.sleep(0.5)
    smi.terminate()
    out = smi.communicate()[0]
    samples = []
    for line in out.splitlines():
        try:
            ts, clk = line.split(",")
            t = datetime.datetime.strptime(ts.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((t, float(clk)))
        except ValueError:
            continue
    top = max(c for _, c in samples) if samples else float("nan")
    print(f"{len(samples)} clock samples; top SM clock {top:.0f} MHz")
    for name, (t0, t1, per) in windows.items():
        x = _window(samples, t0, t1)
        if x.size == 0:
            print(f"  {name:26s} no samples in its window")
            continue
        print(f"  {name:26s} {per * 1e6:8.1f} us per call; SM clock min {x.min():.0f} median {np.median(x):.0f} MHz, "
              f"{np.mean(x >= top) * 100:.0f} % of {x.size} samples at {top:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
