"""Experiment: the decode partials kernel's workgroup size and prefetch, per runtime.

For the bench's decode layer workload (B = 32, L = 32k, one query each, Hq = 32, Hkv = 4,
D = 128, top-16 of 128-token blocks, float16 caches resident) it times one decode call's
partials and combine (``profile_forward``'s ``call_s``: GPU timestamps, steady state) with
``decode_workgroup_size`` in 32, 64, 128 and ``decode_prefetch`` off and on, each on a fresh
device of each backend given, two rounds in turn, and prints the medians (µs) and each
configuration's largest difference to the default's output.

    python scripts/experiment_decode_geometry.py [--backends wgpu dawn] [--repeat 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    import _layer_inputs as li

    import paged_sparse_attn as psa
    from paged_sparse_attn._validation import validate_forward

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["wgpu", "dawn"])
    ap.add_argument("--repeat", type=int, default=8)
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs("decode")
    w = lw.w
    ix = psa.build_kvouter_index(prob["selected"], prob["block_tables"], prob["cu_seqlens_q"], prob["used_kv_lens"],
                                 block_size=w.block_size, page_size=w.page_size, causal=w.causal)
    configs = [(None, None)] + [(wg, pf) for wg in (32, 64, 128) for pf in (False, True)]
    times: dict = {}
    outs: dict = {}
    for _ in range(2):
        for name in a.backends:
            cls = type(psa.get_backend(name))
            for wg, pf in configs:
                be = cls(timestamps=True, decode_workgroup_size=wg, decode_prefetch=pf)
                k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
                p = validate_forward("experiment", prob["q"], k, v, prob["block_tables"], prob["selected"],
                                     prob["cu_seqlens_q"], used_kv_lens=prob["used_kv_lens"], block_size=w.block_size,
                                     softmax_scale=None, causal=w.causal)
                prof = be.profile_forward(p, ix, repeat=a.repeat, replay="auto", warmup_s=0.5)
                times.setdefault((name, wg, pf), []).append(prof["call_s"] * 1e6)
                out = np.asarray(psa.forward(prob["q"], k, v, prob["block_tables"], prob["selected"],
                                             prob["cu_seqlens_q"], used_kv_lens=prob["used_kv_lens"],
                                             block_size=w.block_size, causal=w.causal, backend=be))
                outs.setdefault((name, wg, pf), out)
                be.close()
    for (name, wg, pf), ts in times.items():
        ref = outs[(name, None, None)]
        diff = float(np.max(np.abs(outs[(name, wg, pf)] - ref)))
        label = "default" if wg is None else f"wg {wg:3d} prefetch {int(pf)}"
        print(f"{name:5s} {label:22s} partials+combine us: {np.median(ts):7.1f} rounds {[round(t, 1) for t in ts]} "
              f"max |out - default| {diff:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
