"""Experiment: block shapes of the GEMM ceiling's tiled kernel that ``GEMM_VARIANTS`` does not try.

``psa_gemm_sgmat_tiled.wgsl`` as it is, with override constants outside the table of
``_ceilings.GEMM_VARIANTS``: one-stage blocks with larger K steps or fewer subgroups (less
workgroup memory, so that more workgroups may be resident), 256 x 128 in one stage, and the
best block of the table with more padding per staged row, and (not yet timed) blocks of three
subgroup columns or rows, 128 x 192 and 192 x 128, the only double-buffered blocks of 8 subgroups
of 64 x 48 or 48 x 64 results that fit 48 KiB with padded rows (45 and 47 KiB): one barrier per
K step instead of two; and the table's best block in K steps of 48 (39 KiB; K steps of 64 need
51 KiB): two barriers per 48 of K instead of per 32. Each is timed and checked against the bound of float32 accumulation by
the ceiling's own harness (``matmul_variants``), ``--rounds`` times in turn on one Dawn device,
beside the table's best (128 x 256, BK 32, one stage) and torch's bf16 matmul of the same shape
in the same process. A block that does not divide the shape is skipped and says so: the blocks
of 192 and the K steps of 48 need a shape such as ``--shape 4608 4608 4608`` (every block
above divides it).

    python scripts/experiment_gemm_shapes.py [--size 4096 | --shape M N K] [--rounds 2] [--only I ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu._ceilings import (
    GEMM_TILED_KERNEL,
    _variant,
    matmul_variants,
)

T = GEMM_TILED_KERNEL
SHAPES = (
    _variant(T, SGM=2, SGN=4, TM=4, TN=4, BK=32, STAGES=1),            # the table's best (reference)
    _variant(T, SGM=4, SGN=2, TM=4, TN=4, BK=32, STAGES=1),            # 256 x 128, one stage (29 KiB)
    _variant(T, SGM=2, SGN=2, TM=4, TN=4, BK=64, STAGES=1),            # 128 x 128, 4 subgroups, K 64 (35 KiB)
    _variant(T, SGM=2, SGN=2, TM=4, TN=4, BK=32, STAGES=1),            # 128 x 128, 4 subgroups, one stage (19 KiB)
    _variant(T, SGM=4, SGN=2, TM=2, TN=4, BK=64, STAGES=1),            # 128 x 128, 8 of 32 x 64, K 64 (35 KiB)
    _variant(T, SGM=1, SGN=4, TM=4, TN=4, BK=32, STAGES=2),            # 64 x 256, 4 subgroups, two stages (43 KiB)
    _variant(T, SGM=2, SGN=4, TM=4, TN=4, BK=16, STAGES=1),            # 128 x 256, K 16, one stage (13 KiB)
    _variant(T, SGM=2, SGN=4, TM=4, TN=4, BK=32, STAGES=1, PAD=16),    # the best with 16 halves of padding
    _variant(T, SGM=2, SGN=4, TM=4, TN=4, BK=32, STAGES=1, PAD=24),
    _variant(T, SGM=2, SGN=4, TM=4, TN=3, BK=32, STAGES=2),            # 128 x 192, two stages (45 KiB)
    _variant(T, SGM=4, SGN=2, TM=3, TN=4, BK=32, STAGES=2),            # 192 x 128, two stages (47 KiB)
    _variant(T, SGM=2, SGN=4, TM=4, TN=4, BK=48, STAGES=1),            # the best in K steps of 48 (39 KiB)
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--shape", type=int, nargs=3, metavar=("M", "N", "K"), help="instead of size^3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=float, default=0.05, help="seconds of warm-up runs per variant (the ceiling: 0.3)")
    ap.add_argument("--only", type=int, nargs="+", metavar="I",
                    help="time only these rows of SHAPES (0: the table's best)")
    a = ap.parse_args()
    m, n, k = a.shape or (a.size,) * 3
    shapes = SHAPES if a.only is None else tuple(SHAPES[i] for i in a.only)
    ctx = registry.get_backend("dawn").device_context
    print(f"device: {ctx.summary}; workgroup memory {ctx.workgroup_storage} B", flush=True)
    rates: dict = {}
    for r in range(a.rounds):
        for row in matmul_variants(ctx, m, n, k, repeat=a.repeat, variants=shapes, seed=r,
                                   warmup_s=a.warmup):
            if row["skipped"]:
                print(f"  {row['name']}: skipped: {row['skipped']}", flush=True)
                continue
            rates.setdefault(row["name"], []).append((row["flop_per_s"] / 1e12, row["ok"]))
            print(f"  round {r} {row['name']} ({row['workgroup_bytes']} B): {row['flop_per_s'] / 1e12:.1f} TFLOP/s "
                  f"{'PASS' if row['ok'] else 'FAIL'} (max err {row['max_abs_err']:.2e}, bound {row['err_bound']:.2e})",
                  flush=True)
    try:
        import torch

        if torch.cuda.is_available():
            from paged_sparse_attn.bench.peers import matmul_rate

            tr = matmul_rate(m, n=n, k=k) / 1e12
            print(f"torch bf16 matmul {m} x {n} x {k}: {tr:.1f} TFLOP/s", flush=True)
            for name, xs in rates.items():
                print(f"{name}: {' / '.join(f'{x:.1f}' for x, _ in xs)} TFLOP/s, "
                      f"{max(x for x, _ in xs) / tr:.0%} of torch; all PASS: {all(ok for _, ok in xs)}", flush=True)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
