"""Experiment: where the tensor-core block scores (psa_block_scores_sgmat.wgsl) spend their time.

Not a check: each variant is the kernel with one part left out (results are wrong on purpose),
timed on the prefill shape (Tq = 4096, L = 32k, Hkv = 4, d_idx = 128, float16 keys) with GPU
timestamps, as ``scripts/check_sgmat_scores.py`` times the kernel itself. The variants are source
edits registered for this process only. Run on a machine with Dawn and f16 subgroup matrices:

    python scripts/experiment_scores_split.py [--repeat 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import check_sgmat_scores as chk
from _wgsl_variants import original, register

from paged_sparse_attn.backends.wgpu import _index_branch as ib
from paged_sparse_attn.backends.wgpu import _kernels

BASE = ib.SCORES_SGMAT
LO = [f"acc = subgroupMatrixMultiplyAccumulate(l{k}, b, acc);" for k in range(8)]
HI = [f"acc = subgroupMatrixMultiplyAccumulate(h{k}, b, acc);" for k in range(8)]
EDITS = {
    "as is": [],
    "no exact path in the fold": [("z = exact_logit(qo, kb + (fh + c) * KS);", "z = 0.0;")],
    "no fold": [("if (live && kb != INVALID) {", "if (false) {")],
    "no lo products": [(x, "") for x in LO],
    "no products (nor key loads)": [(x, "") for x in LO + HI],
    "no barrier after the result stores": [("workgroupBarrier();  // the stores are visible", "//")],
    "no result stores": [("subgroupMatrixStore<row_major>(&res, rb + 16u * u, acc, RW);", "")],
}



def variant(i: int, edits) -> str:
    """The kernel with ``edits`` made, registered under a name of its own."""
    src = original(BASE)
    for a, b in edits:
        if a not in src:
            raise SystemExit(f"edit not found: {a!r}")
        src = src.replace(a, b)
    return register(f"x_scores_split_{i}.wgsl", src, _kernels.KERNEL_TABLE[BASE])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    from paged_sparse_attn import registry
    from paged_sparse_attn.backends.wgpu.backend import DawnBackend

    p = chk.problem(np.random.default_rng(0), [4096], [32768], Hkv=4, poison=False)
    names = {k: variant(i, e) for i, (k, e) in enumerate(EDITS.items())}
    for label, be in (("dawn", registry.get_backend("dawn")), ("dawn robustness=False", DawnBackend(robustness=False))):
        be._scores_kernel = "sgmat"
        order = list(EDITS) + ["as is"]
        for k in order:
            ib.SCORES_SGMAT = names[k]
            try:
                t, _ = chk.gpu_time(be, p, a.repeat)
                print(f"{label:22s} {k:38s} {t * 1e3:8.3f} ms", flush=True)
            finally:
                ib.SCORES_SGMAT = BASE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
