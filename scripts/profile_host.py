"""Where the host time of ``forward()`` goes: cProfile of decode calls with host arrays.

Usage: ``python scripts/profile_host.py [--backend wgpu] [--calls 200] [--workload decode]``;
prints the functions with the most cumulative time. Measures what a user's call runs (host
q and selection in, host out and lse back), on device-resident caches.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

import paged_sparse_attn as psa
from paged_sparse_attn.bench.layer import LAYER_WORKLOADS, QUICK_LAYER_WORKLOADS
from paged_sparse_attn.bench.workloads import make_problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="wgpu")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--workload", default="decode")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    lw = {x.w.name: x for x in (*LAYER_WORKLOADS, *QUICK_LAYER_WORKLOADS)}[a.workload]
    p = make_problem(lw.w, seed=1, fill="selected")
    be = psa.get_backend(a.backend)
    k, v = be.upload_kv_cache(p["k_cache"], p["v_cache"])
    args = (p["q"], k, v, p["block_tables"], p["selected"], p["cu_seqlens_q"])
    kw = dict(used_kv_lens=p["used_kv_lens"], block_size=p["block_size"], causal=p["causal"], backend=be)
    for _ in range(20):
        psa.forward(*args, **kw)
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        psa.forward(*args, **kw)
    prof.disable()
    wall = (time.perf_counter() - t0) / a.calls
    print(f"forward() {a.workload}: {wall * 1e6:.0f} us per call under the profiler; last call's split: "
          f"{ {k: round(v * 1e6) for k, v in be.last_timings.items() if isinstance(v, float)} } us")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(a.top)
    t0 = time.perf_counter()
    for _ in range(a.calls):
        psa.forward(*args, **kw)
    print(f"forward() without the profiler: {(time.perf_counter() - t0) / a.calls * 1e6:.0f} us per call")
    np.asarray(0)


if __name__ == "__main__":
    main()
