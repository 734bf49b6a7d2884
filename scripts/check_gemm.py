"""Check and time every subgroup-matrix GEMM variant of the matmul ceiling on a GPU.

Run on a machine with Dawn (the ``wgpudawn`` package) and a GPU with f16 subgroup matrices:

    python scripts/check_gemm.py [--backend dawn] [--size 4096] [--repeat 10] [--no-torch] [--no-robustness]

For each variant of ``_ceilings.GEMM_VARIANTS`` (the naive ``psa_gemm_sgmat.wgsl`` and the
workgroup-memory tiled ``psa_gemm_sgmat_tiled.wgsl`` in several block shapes) it prints one line:
PASS (every checked element of C within the bound of float32 accumulation), FAIL, or SKIP (does
not fit this device, and why), with the rate, the time and the largest error against its bound.
It runs ``matmul_variants`` twice: a rectangular problem (M, N, K all different, so that a
confusion of the three shows) and the square ``size``^3 ceiling; then names the fastest correct
variant, and, where torch with CUDA is importable, torch's bf16 matmul rate beside it. The exit
status is the number of FAILs. It takes well under a minute on an H200.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu._ceilings import matmul_variants
from paged_sparse_attn.backends.wgpu._device import subgroup_size


def show(rows: list[dict], what: str) -> list[str]:
    fails = []
    for r in rows:
        if r["skipped"]:
            print(f"SKIP {what} {r['name']}: {r['skipped']}", flush=True)
            continue
        tag = "PASS" if r["ok"] else "FAIL"
        if not r["ok"]:
            fails.append(f"{what} {r['name']}")
        print(f"{tag} {what} {r['name']}: {r['flop_per_s'] / 1e12:7.1f} TFLOP/s  {r['gemm_s'] * 1e3:8.3f} ms  "
              f"max_abs_err {r['max_abs_err']:.3g} (bound {r['err_bound']:.3g})  block {r['block']}  "
              f"{r['workgroup_bytes']} B  [{r['timer']}]", flush=True)
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true", help="do not time torch's bf16 matmul")
    ap.add_argument("--no-robustness", action="store_true",
                    help="open Dawn without its bounds checks (DawnBackend(robustness=False))")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.no_robustness:
        from paged_sparse_attn.backends.wgpu.backend import DawnBackend

        be = DawnBackend(robustness=False)
    else:
        be = registry.get_backend(a.backend)
    ctx = be.device_context
    print(f"device: {ctx.summary} ({ctx.runtime.name}); subgroup matrices {sorted(ctx.sgmat)}; subgroup size "
          f"{subgroup_size(ctx)[0]}; workgroup memory {ctx.workgroup_storage} B; invocations {ctx.max_invocations}",
          flush=True)
    fails = show(matmul_variants(ctx, 512, 768, 1024, repeat=1, seed=1), "512x768x1024")
    rows = matmul_variants(ctx, a.size, repeat=a.repeat)
    fails += show(rows, f"{a.size}^3")
    good = [r for r in rows if not r["skipped"] and r["ok"]]
    if good:
        best = max(good, key=lambda r: r["flop_per_s"])
        print(f"best: {best['name']}: {best['flop_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    if not a.no_torch:
        try:
            import torch

            if torch.cuda.is_available():
                from paged_sparse_attn.bench.peers import matmul_rate as torch_rate

                tr = torch_rate(a.size)
                print(f"torch bf16 matmul {a.size}^3: {tr / 1e12:.1f} TFLOP/s"
                      + (f"; best variant at {best['flop_per_s'] / tr:.0%} of it" if good else ""), flush=True)
        except ImportError:
            pass
    print(f"{len(fails)} FAIL{'S' if len(fails) != 1 else ''} in {time.perf_counter() - t0:.1f} s"
          + (": " + ", ".join(fails) if fails else ""), flush=True)
    return len(fails)


if __name__ == "__main__":
    sys.exit(main())
