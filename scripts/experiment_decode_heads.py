"""The decode partials with fewer query heads per work item: NG heads of an edge per workgroup
(the host's choice is all G = 8 of them; 4 or 2 split an edge into 2 or 4 items, each reading the
edge's keys and values, with fewer registers per lane).

Usage: ``python scripts/experiment_decode_heads.py [dawn|wgpu]`` (``QUICK=1``: a small problem for
a CPU driver). The layer suite's decode workload, the plan's ``run`` on a device with timestamps;
per configuration (NG, workgroup size) the median GPU time of partials and combine over 10 calls,
in three alternating rounds, a fresh device each, and the largest difference of ``out`` from the
first configuration's. H200 output: ``docs/benchmarks-data/h200-decode-heads-2026-12-02.txt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _layer_inputs import layer_inputs

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _decode
from paged_sparse_attn.bench.layer import _plan

CONFIGS = ((8, None), (4, None), (4, 64), (2, None))  # (heads per item, decode workgroup size)


def main(name: str) -> None:
    quick = bool(os.environ.get("QUICK"))
    lw, prob, _, _ = layer_inputs("decode", (1, 256) if quick else None)
    cls = type(registry.get_backend(name))
    q = prob["q"].astype(np.float32)
    res: dict = {c: [] for c in CONFIGS}
    ref = None
    for rnd in range(1 if quick else 3):
        for ng, wg in CONFIGS:
            _decode.MAX_NG = ng  # (read when the plan chooses its geometry)
            be = cls(timestamps=True, **({"decode_workgroup_size": wg} if wg else {}))
            k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
            plan = _plan(be, lw, prob)
            ts = []
            for _ in range(12):
                out = plan.run(q, k, v, prob["selected"])
                ts.append(be.last_timings.get("gpu_attention_s", float("nan")))
            t = float(np.median(ts[2:])) * 1e6
            ref = out if ref is None else ref
            res[(ng, wg)].append(t)
            print(f"round {rnd} NG={ng} WG={wg}: partials+combine {t:.1f} us  geometry {plan._runtime.geometry}  "
                  f"max|d out| from the first {float(np.max(np.abs(out - ref))):.2e}", flush=True)
            plan.close()
            k.release()
            v.release()
            be.close()
    _decode.MAX_NG = 8
    for c, v in res.items():
        print("median", c, f"{np.median(v):.1f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dawn")
