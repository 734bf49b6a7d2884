"""Experiment: a decode ``forward()`` with host arrays, with and without the plan's host memory
(Dawn's ``host-mapped-pointer``: pinned inputs, results written and lent in host memory).

Each variant runs in a process of its own (two Dawn devices in one process time-slice the GPU
and slow both), one after the other, ``--processes`` times: the bench's decode layer workload
(B = 32, L = 32k, one query each, Hq = 32, Hkv = 4, D = 128, top-16 of 128-token blocks, float16
caches resident), ``forward()`` on 32 float32 query sets in turn, 5 rounds of 64 calls; per
process the median over rounds of each round's median wall time per call, the rounds, and the
last call's ``last_timings``. The outputs of the first call are compared bit for bit.

    python scripts/experiment_forward_host_io.py [--processes 2]
    python scripts/experiment_forward_host_io.py --variant hostio     # one process, one variant
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {"hostio": (), "nohostio": ("host-mapped-pointer",), "wgpu": None}


def one(variant: str, save: str | None) -> None:
    import _layer_inputs as li

    import paged_sparse_attn as psa

    lw, prob, _, _ = li.layer_inputs("decode")
    if VARIANTS[variant] is None:
        be = psa.get_backend("wgpu")
    else:
        be = type(psa.get_backend("dawn"))(disable_features=VARIANTS[variant])
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(32)]
    k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
    rounds = []
    for r in range(5):
        ts = []
        for i in range(64):
            t = time.perf_counter()
            out = psa.forward(qs[i % 32], k, v, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"],
                              used_kv_lens=prob["used_kv_lens"], block_size=lw.w.block_size, causal=lw.w.causal,
                              backend=be)
            ts.append(time.perf_counter() - t)
            if save and r == 0 and i == 0:
                np.save(save, out)
        rounds.append(float(np.median(ts)) * 1e6)
    last = {a: round(b * 1e6, 1) for a, b in be.last_timings.items() if isinstance(b, float)}
    print(f"{variant:8s} forward() us: median {np.median(rounds):.1f} rounds {[round(x) for x in rounds]} {last}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=list(VARIANTS))
    ap.add_argument("--save", help="(with --variant) save the first call's out here (.npy)")
    ap.add_argument("--processes", type=int, default=2)
    a = ap.parse_args()
    if a.variant:
        one(a.variant, a.save)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.processes):
            for name in VARIANTS:
                subprocess.run([sys.executable, __file__, "--variant", name, "--save", os.path.join(tmp, f"{name}.npy")],
                               check=True)
        outs = {n: np.load(os.path.join(tmp, f"{n}.npy")) for n in VARIANTS}
        print("same bits as hostio:", {n: bool(np.array_equal(o, outs["hostio"])) for n, o in outs.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
