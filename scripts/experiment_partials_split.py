"""Experiment: where the tensor-core prefill partials (psa_partials_sgmat.wgsl) spend their time.

Not a check: each variant is the kernel with one part left out (results are wrong on purpose),
registered under the kernel's own name for this process only, and timed on the bench's prefill
layer workload (B = 1, L = 32k, the last 4096 queries, causal, top-16 of 128-token blocks,
float16 caches) as the GPU time of a planned attention call's partials and combine (timestamps),
each variant on a fresh device, in alternating rounds. Run on a machine with Dawn and f16
subgroup matrices:

    python scripts/experiment_partials_split.py [--rounds 2] [--calls 4]
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
from paged_sparse_attn.backends.wgpu import _kernels

BASE = "psa_partials_sgmat.wgsl"
S_PRODUCTS = ["                    acc = subgroupMatrixMultiplyAccumulate(ah, b, acc);\n",
              "                    acc = subgroupMatrixMultiplyAccumulate(al, b, acc);\n"]
PV_PRODUCTS = [f"                acc{i} = subgroupMatrixMultiplyAccumulate({x}, b, acc{i});\n"
               for i in range(8) for x in ("ah", "al")]
EDITS = {
    "as is": [],
    "no S = Q K^T products (nor their matrix loads)": [(x, "") for x in S_PRODUCTS],
    "no P V products (nor their matrix loads)": [(x, "") for x in PV_PRODUCTS],
    "no products at all": [(x, "") for x in S_PRODUCTS + PV_PRODUCTS],
    "no K/V reads from the cache (zeros staged)": [
        ("                u = k_cache[row + x - k * D8];", "                u = vec4<u32>(row & 0u);"),
        ("                u = v_cache[row + x - k * D8];", "                u = vec4<u32>(row & 0u);")],
    # finer parts of the per-item work (each alone left out)
    "no query loads (zeros split)": [("        v = q[row_q[r] + x - r * QV];", "        v = vec4<f32>(f32(row_q[r] & 0u));")],
    "no K/V tile stores but one half per unit": [
        (("    hmem[b + 1u] = h0.y;\n    hmem[b + 2u] = h1.x;\n    hmem[b + 3u] = h1.y;\n    hmem[b + 4u] = h2.x;\n"
          "    hmem[b + 5u] = h2.y;\n    hmem[b + 6u] = h3.x;\n    hmem[b + 7u] = h3.y;\n"), "")],
    "no score rescale pass": [("                sbuf[i] = (sbuf[i] * row_down[r]) * params.scale;\n", "")],
    "no exp in the softmax": [("                p = select(exp(sc - m_new), REMOVED, is_ninf(sc));",
                               "                p = select(sc - m_new, REMOVED, is_ninf(sc));")],
    "no P stores (the softmax's split weights)": [
        ("            hmem[sr * PB + k] = f16(h);\n            hmem[RMAX * QA + sr * PB + k] = f16(pm - h);\n", "")],
    "no partial rows written": [("        o_out[(prow0 + r) * D + d] = o;",
                                 "        if (o == 1234.5) { o_out[(prow0 + r) * D + d] = o; }")],
    # not a part left out: the rows' largest |q| reduced per subgroup, one atomic per row and
    # subgroup instead of one per lane (right where a subgroup's 32 units are one row: D = 128)
    "query maxima by subgroup (same results)": [
        ("diagnostic(off, chromium.subgroup_matrix_uniformity);\n",
         "diagnostic(off, chromium.subgroup_matrix_uniformity);\ndiagnostic(off, subgroup_uniformity);\n"),
        ("    atomicMax(&row_qmax[x / QV], mb);\n",
         "    let mw = subgroupMax(mb);\n    if ((x & 31u) == 0u) {\n        atomicMax(&row_qmax[x / QV], mw);\n    }\n")],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=4)
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs("prefill")
    src0 = original(BASE)
    row = _kernels.KERNEL_TABLE[BASE]
    res: dict = {}
    outs: dict = {}
    for r in range(a.rounds):
        for label, edits in EDITS.items():
            src = src0
            for old, new in edits:
                if old not in src:
                    raise SystemExit(f"edit not found: {old!r}")
                src = src.replace(old, new)
            register(BASE, src, row)
            be = type(registry.get_backend("dawn"))(timestamps=True)
            try:
                t, out, geo = li.attention_gpu_time(be, lw, prob, a.calls)
                kern = geo.get("kernel")
                res.setdefault(label, []).append(t)
                ref = outs.setdefault("as is", out) if label == "as is" else outs.get("as is")
                same = "" if ref is None else f"  same bits as 'as is': {np.array_equal(out, ref, equal_nan=True)}"
                print(f"round {r}: {label:46s} {t * 1e3:7.3f} ms  (kernel {kern}){same}", flush=True)
            finally:
                be.close()
    register(BASE, src0, row)
    print_medians(res, 46)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
