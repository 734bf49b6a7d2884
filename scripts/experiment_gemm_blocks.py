"""Experiment: more block shapes of the tiled subgroup-matrix GEMM (``psa_gemm_sgmat_tiled.wgsl``)
beside the ceiling's best, at 4096^3 on Dawn: 16 subgroups (512 invocations) per 128 x 256 or
256 x 128 block, 256 x 128 in 8 subgroups of 64 x 64, 256 x 256 blocks, and rows padded by 16
halves instead of 8. Each variant is checked against the bound of f32 accumulation and timed
with the ceiling's harness (``_ceilings.matmul_variants``), two rounds.

    python scripts/experiment_gemm_blocks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_gemm import show

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu._ceilings import GEMM_TILED_KERNEL as TILED
from paged_sparse_attn.backends.wgpu._ceilings import _variant, matmul_variants

VARIANTS = (
    _variant(TILED, SGM=2, SGN=4, TM=4, TN=4, BK=32, STAGES=1),  # the ceiling's best (128 x 256, 8 subgroups)
    _variant(TILED, SGM=2, SGN=8, TM=4, TN=2, BK=32, STAGES=1),
    _variant(TILED, SGM=4, SGN=4, TM=2, TN=4, BK=32, STAGES=1),
    _variant(TILED, SGM=4, SGN=4, TM=4, TN=2, BK=32, STAGES=1),
    _variant(TILED, SGM=4, SGN=2, TM=4, TN=4, BK=32, STAGES=1),
    _variant(TILED, SGM=2, SGN=4, TM=4, TN=4, BK=32, STAGES=1, PAD=16),
    _variant(TILED, SGM=4, SGN=4, TM=4, TN=4, BK=16, STAGES=1),
    _variant(TILED, SGM=4, SGN=4, TM=4, TN=4, BK=16, STAGES=2),
)


def main() -> int:
    ctx = registry.get_backend("dawn").device_context
    fails = show(matmul_variants(ctx, 512, 768, 1024, repeat=1, seed=1, variants=VARIANTS), "512x768x1024")
    for r in range(2):
        fails += show(matmul_variants(ctx, 4096, repeat=10, variants=VARIANTS), f"4096^3 round {r}")
    return len(fails)


if __name__ == "__main__":
    raise SystemExit(main())
