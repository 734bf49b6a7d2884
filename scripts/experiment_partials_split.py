"""Experiment: where the tensor-core prefill partials (psa_partials_sgmat.wgsl) spend their time.

Not a check: each variant is the kernel with one part left out, or stopped after one of its
stages (each stage's row adds that stage to the one above; results are wrong on purpose),
registered under the kernel's own name for this process only, and timed on the bench's prefill
layer workload (B = 1, L = 32k, the last 4096 queries, causal, top-16 of 128-token blocks,
float16 caches) as the GPU time of a planned attention call's partials and combine (timestamps),
each variant on a fresh device, in alternating rounds. Run on a machine with Dawn and f16
subgroup matrices:

    python scripts/experiment_partials_split.py [--rounds 2] [--calls 4] [--rev 66a91ec]

The edits fit the kernel of one workgroup per item, the file at revision 66a91ec (``--rev``, the
default; run from a clone with its history): a stage's exit there ends the item, where in the
kernel whose workgroups loop over items it would end every later item of the workgroup too.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li
from _wgsl_variants import one_item_per_workgroup, print_medians, register

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _kernels

BASE = "psa_partials_sgmat.wgsl"
# the kernel's products (their lines as the kernel has them)
QLO = [f"                    acc = subgroupMatrixMultiplyAccumulate(ql{j}, b, acc);\n" for j in range(16)]
QHI = [f"                    acc = subgroupMatrixMultiplyAccumulate(qh{j}, b, acc);\n" for j in range(16)]
PLO = [f"                acc{i} = subgroupMatrixMultiplyAccumulate(al, b, acc{i});\n" for i in range(8)]
PHI = [f"                acc{i} = subgroupMatrixMultiplyAccumulate(ah, b, acc{i});\n" for i in range(8)]
# each stage's end: the item stops there, writing one value per row that depends on the stage's
# work (so that a compiler keeps it) into ml_out (uniform: the exit depends on params only)
STAGES = {
    "0. work item read, rows and page lists set up": "    // 0. The first K tile",
    "1. + queries loaded, scaled and split": "    // the subgroup's row block of split",
    "2. + scores (S = Q K^T, K tiles staged)": "    // 2. Softmax of the block",
    "3. + softmax (weights split, codes)": "    // 3. o += P V",
}
EXIT_VALUE = {
    "0. work item read, rows and page lists set up": "vec2<f32>(f32(row_len[tid]), f32(key_src[tid % BK]))",
    "1. + queries loaded, scaled and split": "bitcast<vec2<f32>>(wmem[tid].xy)",
    "2. + scores (S = Q K^T, K tiles staged)": "vec2<f32>(s_get(tid, 0u), s_get(tid, 1u))",
    "3. + softmax (weights split, codes)": "vec2<f32>(row_m[tid], row_l[tid]) + bitcast<vec2<f32>>(wmem[tid].xy)",
}


def _exit(label: str) -> list[tuple[str, str]]:
    marker = STAGES[label]
    barrier = "    workgroupBarrier();\n" if label.startswith("3.") else ""  # (the softmax's row_m, row_l)
    return [(marker, f"{barrier}    if (params.scale != 1234.5) {{ if (tid < n_rows) {{ "
                     f"ml_out[prow0 + tid] = {EXIT_VALUE[label]}; }} return; }}\n{marker}")]


EDITS = {
    "as is": [],
    **{f"stage {label}": _exit(label) for label in STAGES},
    "stage 4. + o = P V (all but the partial rows written)": [
        ("        o_out[(prow0 + r) * D + d] = o;", "        if (o == 1234.5) { o_out[(prow0 + r) * D + d] = o; }")],
    # parts left out, each alone
    "no Q lo products": [(x, "") for x in QLO],
    "no P lo products": [(x, "") for x in PLO],
    "no products at all": [(x, "") for x in QLO + QHI + PLO + PHI],
    "no score rescale pass": [("                s_set(r, k, (s_get(r, k) * row_down[r]) * params.scale);",
                               "                if (params.scale == 1234.5) { s_set(r, k, 0.0); }")],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--rev", default="66a91ec", help="the revision whose kernel to split (one workgroup per item)")
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs("prefill")
    src0 = subprocess.run(["git", "show", f"{a.rev}:shaders/{BASE}"], cwd=Path(__file__).resolve().parents[1],
                          check=True, capture_output=True, text=True).stdout
    row = _kernels.KERNEL_TABLE[BASE]
    one_item_per_workgroup()  # (the kernel of --rev: one workgroup per item)
    res: dict = {}
    outs: dict = {}
    for r in range(a.rounds):
        for label, edits in EDITS.items():
            src = src0
            for old, new in edits:
                if old not in src:
                    raise SystemExit(f"edit not found: {old!r}")
                src = src.replace(old, new, 1)
            register(BASE, src, row)
            be = type(registry.get_backend("dawn"))(timestamps=True)
            try:
                t, out, geo = li.attention_gpu_time(be, lw, prob, a.calls)
                kern = geo.get("kernel")
                res.setdefault(label, []).append(t)
                ref = outs.setdefault("as is", out) if label == "as is" else outs.get("as is")
                same = "" if ref is None else f"  same bits as 'as is': {np.array_equal(out, ref, equal_nan=True)}"
                print(f"round {r}: {label:50s} {t * 1e3:7.3f} ms  (kernel {kern}){same}", flush=True)
            finally:
                be.close()
    register(BASE, src0, row)
    print_medians(res, 50)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
