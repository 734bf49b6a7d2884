"""Experiment: what WGSL's subgroup matrices can multiply at all on this GPU, and where the tiled
GEMM ceiling loses the rest.

The GEMM ceiling (``psa_gemm_sgmat_tiled.wgsl``, its best block: 128 x 256 in 8 subgroups of
64 x 64, K steps of 32) is timed as it is and with its parts left out one at a time (timing only:
those products are wrong on purpose, and are not compared):

* ``no storage loads``   the next K step's operand loads from storage are not issued (the staged
                         tiles keep the first step's values; a runtime-false condition, so the
                         registers and code around them stay);
* ``no staging``         nor are the loaded units written to workgroup memory;
* ``no barriers``        nor is there a barrier per K step: the loop is the subgroup-matrix loads
                         from workgroup memory and the products.

and beside them a kernel of products alone (written here, no operand traffic in its loop): each
subgroup loads TM left and TN right 16 x 16 matrices once, then runs ITERS rounds of TM x TN
``subgroupMatrixMultiplyAccumulate`` into TM x TN f32 results and stores them. Its rate bounds
what any WGSL GEMM on this runtime and driver can reach; the target's 50 % of torch's bf16 matmul
is set beside it (torch measured in the same process where it has CUDA).

``--rev REV`` also times (and checks) the tiled kernel as it is at a git revision.

    python scripts/experiment_gemm_peak.py [--backend dawn] [--rounds 2] [--rev REV] [--no-torch]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _wgsl_variants import original, register, use

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _kernels
from paged_sparse_attn.backends.wgpu._ceilings import (
    GEMM_TILED_KERNEL,
    _variant,
    matmul_variants,
    median_time,
    one_dispatch,
)
from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage

BEST = _variant(GEMM_TILED_KERNEL, SGM=2, SGN=4, TM=4, TN=4, BK=32, STAGES=1)
SIZE = 4096
PEAK_KERNEL = "experiment_mma_peak.wgsl"

# (label, [(text in the kernel, its replacement), ...]): cumulative, each row leaves one more part out
_NO_LOADS = ("if (more) {  // issue the next step's loads before the products",
             "if (more && params._pad == 1u) {  // (left out)")
_NO_STAGING = ("if (more) {\n            if (STAGES == 1u) {", "if (more && params._pad == 1u) {\n            if (STAGES == 1u) {")
_NO_BARRIER = ("        }\n        workgroupBarrier();\n    }\n\n    let c0", "        }\n    }\n\n    let c0")
CUTS = (("no storage loads", (_NO_LOADS,)),
        ("no storage loads, no staging", (_NO_LOADS, _NO_STAGING)),
        ("no loads, staging or barriers", (_NO_LOADS, _NO_STAGING, _NO_BARRIER)))

# products alone: each subgroup's TM x TN results, ITERS rounds of products on matrices loaded once.
# One variable per matrix, written out (as in psa_gemm_sgmat_tiled.wgsl: arrays of matrices indexed
# in loops were slower there); the repeated lines are made here, those past TM x TN get no product
# and are stored as zeros.
_IJ = [(i, j) for i in range(4) for j in range(4)]
_LOADS = "\n".join(f"    let {x}{i} = subgroupMatrixLoad<{'Left' if x == 'l' else 'Right'}>(&{'a' if x == 'l' else 'b'}, "
                    f"{256 * i}u, false, 16u);" for x in "lr" for i in range(4))
_ACCS = "\n".join("    " + " ".join(f"var acc{i}{j}: Result;" for j in range(4)) for i in range(4))
_PRODUCTS = "\n".join(
    f"        if (TM > {i}u) {{\n" + "\n".join(
        f"            if (TN > {j}u) {{ acc{i}{j} = subgroupMatrixMultiplyAccumulate(l{i}, r{j}, acc{i}{j}); }}"
        for j in range(4)) + "\n        }" for i in range(4))
_STORES = "\n".join(f"    subgroupMatrixStore(&c, base{f' + {256 * (4 * i + j)}u' if i or j else ''}, acc{i}{j}, false, 16u);"
                     for i, j in _IJ)
PEAK_WGSL = f"""
override SG: u32 = 8u;      // subgroups per workgroup
override TM: u32 = 4u;      // left matrices (result rows of tiles) per subgroup, <= 4
override TN: u32 = 4u;      // right matrices (result columns of tiles) per subgroup, <= 4
override ITERS: u32 = 512u; // rounds of TM x TN products
override WG: u32 = 32u * SG;

struct Params {{ m: u32, n: u32, k: u32, _pad: u32, }}
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<f16>;   // >= 4 x 256 halves
@group(0) @binding(2) var<storage, read> b: array<f16>;   // >= 4 x 256 halves
@group(0) @binding(3) var<storage, read_write> c: array<f32>;  // 16 x 256 floats per subgroup

alias Left = subgroup_matrix_left<f16, 16, 16>;
alias Right = subgroup_matrix_right<f16, 16, 16>;
alias Result = subgroup_matrix_result<f32, 16, 16>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_id) sg: u32) {{
{_LOADS}
{_ACCS}
    for (var t = 0u; t < ITERS; t++) {{
{_PRODUCTS}
    }}
    let base = (wid.x * SG + sg) * 16u * 256u;
{_STORES}
}}
"""
# (SG, TM, TN): workgroups of 8 subgroups with the ceiling's 4 x 4 results each, fewer results
# (more resident subgroups), and 4 subgroups per workgroup
PEAK_SHAPES = ((8, 4, 4), (8, 2, 4), (8, 2, 2), (4, 4, 4), (4, 2, 2), (8, 1, 1))
ITERS = 512


def peak_rates(ctx, groups: int, repeat: int) -> list[tuple[str, float]]:
    """TFLOP/s of the products-alone kernel for each of PEAK_SHAPES."""
    dev = ctx.device
    U = BufferUsage
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(1024) * 0.01).astype(np.float16)
    out = []
    ab = dev.create_buffer_with_data(data=a, usage=U.STORAGE)
    bb = dev.create_buffer_with_data(data=a, usage=U.STORAGE)
    pb = dev.create_buffer_with_data(data=np.zeros(4, np.uint32), usage=U.UNIFORM)
    bufs = [ab, bb, pb]
    try:
        for sg, tm, tn in PEAK_SHAPES:
            cb = dev.create_buffer(size=groups * sg * 16 * 256 * 4, usage=U.STORAGE)
            bufs.append(cb)
            pipe, bgl = _kernels.pipeline(ctx, PEAK_KERNEL, {"SG": sg, "TM": tm, "TN": tn, "ITERS": ITERS})
            bg = dev.create_bind_group(layout=bgl, entries=[
                {"binding": i, "resource": {"buffer": x}} for i, x in enumerate((pb, ab, bb, cb))])
            t, _ = median_time(ctx, one_dispatch(pipe, bg, groups), repeat, 0.05)
            flop = groups * sg * ITERS * tm * tn * 2.0 * 16 ** 3
            out.append((f"products alone: {sg} subgroups x {tm} x {tn} results", flop / t / 1e12))
    finally:
        for x in bufs:
            x.destroy()
    return out


def torch_rate() -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        x @ y
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        x @ y
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3)
    return 2.0 * SIZE ** 3 / float(np.median(ts)) / 1e12


def add_arguments(ap) -> None:
    """The options of the GEMM experiments: ``--backend``, ``--rounds``, ``--repeat``, ``--no-torch``."""
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--rev", action="append", default=[], help="a git revision whose tiled kernel to time too")
    a = ap.parse_args()
    register(PEAK_KERNEL, PEAK_WGSL, _kernels.KERNEL_TABLE[GEMM_TILED_KERNEL])
    base = original(GEMM_TILED_KERNEL)
    root = Path(__file__).resolve().parents[1]
    revs = {rev: subprocess.run(["git", "show", f"{rev}:shaders/{GEMM_TILED_KERNEL}"], cwd=root, check=True,
                                capture_output=True, text=True).stdout for rev in a.rev}
    fails = 0
    for r in range(a.rounds):
        rows = []
        runs = [("as it is", base, ())] + [(f"at {rev}", src, ()) for rev, src in revs.items()] + [
            (label, base, cuts) for label, cuts in CUTS]
        for label, src, cuts in runs:
            for old, new in cuts:
                if src.count(old) != 1:
                    raise SystemExit(f"{label}: the kernel no longer has exactly one {old!r}")
                src = src.replace(old, new)
            use({GEMM_TILED_KERNEL: src} if src is not base else {})
            register(PEAK_KERNEL, PEAK_WGSL, _kernels.KERNEL_TABLE[GEMM_TILED_KERNEL])
            be = type(registry.get_backend(a.backend))()  # a fresh device: no cached pipeline of another source
            try:
                row = matmul_variants(be.device_context, SIZE, repeat=a.repeat, variants=(BEST,))[0]
                if row["skipped"]:
                    raise SystemExit(f"{BEST.name}: {row['skipped']}")
                if not cuts and not row["ok"]:
                    fails += 1
                    print(f"FAIL {label}: max |C - A B| {row['max_abs_err']:.3g} > bound {row['err_bound']:.3g}")
                rows.append((f"tiled 128 x 256, {label}" + ("" if not cuts else " (wrong on purpose)"),
                             row["flop_per_s"] / 1e12))
                if label == "as it is":
                    rows += peak_rates(be.device_context, 132 * 16, a.repeat)
            finally:
                be.close()
        use({})
        for label, tf in rows:
            print(f"round {r}: {label:62s} {tf:7.1f} TFLOP/s", flush=True)
    if not a.no_torch:
        t = torch_rate()
        if t is None:
            print("torch bf16 matmul: torch with CUDA not available")
        else:
            print(f"torch bf16 matmul {SIZE}^3: {t:.1f} TFLOP/s; 50 % of it: {t / 2:.1f} TFLOP/s")
    return fails


if __name__ == "__main__":
    raise SystemExit(main())
