"""Experiment: the matmul ceiling's tiled kernel with A (the left-hand operand) loaded as left
matrices straight from storage, only B staged in workgroup memory.

The tensor-core block scores became 1.8 x faster when their storage operand (the index keys)
became the left-hand matrices (docs/benchmarks.md, 2026-12-02 07:21). This script asks the same
of the GEMM ceiling (``psa_gemm_sgmat_tiled.wgsl``): each subgroup loads its TM left matrices of
A per 16 columns of K from storage (row-major, the rows of A), so A is neither staged nor
copied, and B is staged as before. The variants are source edits registered for this process
only, timed and checked against the float64 product by the ceiling's own harness
(``_ceilings.matmul_variants``) beside the kernel as it is. Run on a machine with Dawn and f16
subgroup matrices:

    python scripts/experiment_gemm_left.py [--size 4096] [--repeat 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _wgsl_variants import original, register

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _ceilings, _kernels

BASE = _ceilings.GEMM_TILED_KERNEL
EDITS = [
    ("@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;",
     "@group(0) @binding(1) var<storage, read> a: array<f16>;  // read as left matrices, not staged"),
    ("override A_UNITS: u32 = BM * A_ROW_UNITS / WG;", "override A_UNITS: u32 = 0u;  // A is not staged"),
    ("override A_LEN: u32 = STAGES * A_STAGE;", "override A_LEN: u32 = 8u;"),
    ("        ra[i] = a[(row0 + u / A_ROW_UNITS) * kq + u % A_ROW_UNITS];", "        ra[i] = vec4<u32>(0u);"),
    ("                ra[i] = a[(row0 + u / A_ROW_UNITS) * kq + kn / 8u + u % A_ROW_UNITS];",
     "                ra[i] = vec4<u32>(0u);"),
    ("        let sa0 = (t % STAGES) * A_STAGE + srow * SA;",
     "        let ga0 = (row0 + srow) * k_len + t * BK;  // this subgroup's rows of A, this step's K"),
    ("subgroupMatrixLoad<Left, row_major>(&sa, sa0 + kk, SA)", "subgroupMatrixLoad<Left, row_major>(&a, ga0 + kk, k_len)"),
    ("subgroupMatrixLoad<Left, row_major>(&sa, sa0 + 16u * SA + kk, SA)",
     "subgroupMatrixLoad<Left, row_major>(&a, ga0 + 16u * k_len + kk, k_len)"),
    ("subgroupMatrixLoad<Left, row_major>(&sa, sa0 + 32u * SA + kk, SA)",
     "subgroupMatrixLoad<Left, row_major>(&a, ga0 + 32u * k_len + kk, k_len)"),
    ("subgroupMatrixLoad<Left, row_major>(&sa, sa0 + 48u * SA + kk, SA)",
     "subgroupMatrixLoad<Left, row_major>(&a, ga0 + 48u * k_len + kk, k_len)"),
]


@dataclasses.dataclass(frozen=True)
class LeftVariant(_ceilings.GemmVariant):
    """A tiled variant of the edited kernel: the tiled geometry, only B's workgroup memory."""

    @property
    def tiled(self) -> bool:
        return True

    @property
    def workgroup_bytes(self) -> int:
        c = self.c
        _, bn, bk = self.block
        return -(-2 * c["STAGES"] * bk * (bn + c.get("PAD", 8)) // 16) * 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    src = original(BASE)
    for old, new in EDITS:
        if old not in src:
            raise SystemExit(f"edit not found: {old!r}")
        src = src.replace(old, new)
    name = register("x_gemm_left.wgsl", src, _kernels.KERNEL_TABLE[BASE])
    shapes = ({"SGM": 2, "SGN": 4, "TM": 4, "TN": 4, "BK": 32, "STAGES": 1},
              {"SGM": 2, "SGN": 4, "TM": 4, "TN": 4, "BK": 32, "STAGES": 2},
              {"SGM": 2, "SGN": 4, "TM": 4, "TN": 2, "BK": 64, "STAGES": 1},
              {"SGM": 2, "SGN": 4, "TM": 4, "TN": 2, "BK": 32, "STAGES": 2},
              {"SGM": 4, "SGN": 2, "TM": 4, "TN": 4, "BK": 32, "STAGES": 2},
              {"SGM": 2, "SGN": 2, "TM": 4, "TN": 4, "BK": 64, "STAGES": 2})
    variants = [_ceilings.GemmVariant("as is " + " ".join(f"{k}={v}" for k, v in shapes[0].items()), BASE,
                                      tuple(shapes[0].items()))]
    variants += [LeftVariant("A left from storage " + " ".join(f"{k}={v}" for k, v in c.items()), name,
                             tuple(c.items())) for c in shapes]
    be = registry.get_backend("dawn")
    ctx = be._device()
    for r in range(a.rounds):
        for row in _ceilings.matmul_variants(ctx, a.size, repeat=a.repeat, variants=tuple(variants)):
            if row["skipped"]:
                print(f"round {r}: {row['name']:60s} skipped: {row['skipped']}", flush=True)
                continue
            ok = "PASS" if row["ok"] else "FAIL"
            print(f"round {r}: {ok} {row['name']:60s} {row['flop_per_s'] / 1e12:7.1f} TFLOP/s  "
                  f"{row['gemm_s'] * 1e3:7.3f} ms  max_abs_err {row['max_abs_err']:.3g} (bound {row['err_bound']:.3g})",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
