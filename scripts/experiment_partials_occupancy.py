"""Experiment: does the tensor-core prefill partials kernel gain from workgroups that fit more
per SM? ``psa_partials_sgmat.wgsl`` sizes its two matrix arrays (``HCAP`` float16, ``SCAP``
float32) as constants for the largest geometry, so a smaller geometry never needed less
workgroup memory. Each variant here is the kernel with those constants cut to what its geometry
(rows per item, keys per K/V tile, subgroups) uses, and the host's geometry set to it, timed on
the bench's prefill layer workload (B = 1, L = 32k, the last 4096 queries, causal, top-16 of
128-token blocks, float16 caches) as the GPU time of a planned attention call's partials and
combine (timestamps), each variant on a fresh device, in alternating rounds. The output of each
variant is compared with the kernel as it is (it must be the same up to the order of nothing:
the products and sums are the same, only the staging differs).

    python scripts/experiment_partials_occupancy.py [--rounds 2] [--calls 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li
from _wgsl_variants import original, print_medians, register

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _kernels, _sgmat

BASE = "psa_partials_sgmat.wgsl"
SM_BYTES = 233472  # shared memory of an H200 SM that workgroups can use (1 KiB more each reserved)
# label: (rows per item, keys per K/V tile, subgroups, cut the constant arrays to the geometry)
VARIANTS = {
    "as is (32 rows, 32 keys, 8 subgroups)": (32, 32, 8, False),
    "32 rows, 16 keys, 8 subgroups, arrays cut": (32, 16, 8, True),
    "32 rows, 16 keys, 4 subgroups, arrays cut": (32, 16, 4, True),
    "32 rows, 32 keys, 4 subgroups": (32, 32, 4, False),
    "16 rows, 32 keys, 4 subgroups, arrays cut": (16, 32, 4, True),
    "16 rows, 16 keys, 4 subgroups, arrays cut": (16, 16, 4, True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--workload", default="prefill")
    ap.add_argument("--shape", type=int, nargs=2, default=None, metavar=("TQ", "L"))
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs(a.workload, a.shape)
    src0 = original(BASE)
    row = _kernels.KERNEL_TABLE[BASE]
    hcap0, scap0, cand0 = _sgmat.HCAP, _sgmat.SCAP, _sgmat._candidates
    res: dict = {}
    ref = None
    D, BK = prob["q"].shape[2], 128
    for r in range(a.rounds):
        for label, (R, TK, nsg, cut) in VARIANTS.items():
            hcap = 2 * R * max(D + 8, BK + 8) + TK * (D + 8) if cut else hcap0
            scap = R * (max(BK, D) + 4) if cut else scap0
            src = src0.replace(f"const HCAP: u32 = {hcap0}u;", f"const HCAP: u32 = {hcap}u;")
            src = src.replace(f"const SCAP: u32 = {scap0}u;", f"const SCAP: u32 = {scap}u;")
            register(BASE, src, row)
            _sgmat.HCAP, _sgmat.SCAP = hcap, scap
            _sgmat._candidates = lambda ctx, D_, bs, rows, g=(R, TK, BK, 32 * nsg): g
            be = type(registry.get_backend("dawn"))(timestamps=True)
            try:
                t, out, geo = li.attention_gpu_time(be, lw, prob, a.calls)
                if ref is None:
                    ref = out
                diff = float(np.nanmax(np.abs(out - ref))) if out.shape == ref.shape else float("nan")
                same = bool(np.array_equal(out, ref, equal_nan=True))
                nb = _sgmat.sgmat_workgroup_bytes(D, R, BK)
                res.setdefault(label, []).append(t)
                print(f"round {r}: {label:44s} {t * 1e3:7.3f} ms  workgroup {nb} B "
                      f"({SM_BYTES // (nb + 1024)} per SM)  kernel {geo.get('kernel')} RMAX {geo.get('RMAX')} "
                      f"TK {geo.get('TK')} WG {geo.get('WG')}  same bits {same} (max diff {diff:.3g})", flush=True)
            finally:
                be.close()
    register(BASE, src0, row)
    _sgmat.HCAP, _sgmat.SCAP, _sgmat._candidates = hcap0, scap0, cand0
    print_medians(res, 44)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
