"""Experiment: does each runtime's compiler fuse `a * b + c` into one multiply-add?

Not a kernel of the library: one WGSL kernel, registered for this process only, runs chains of
dependent multiply-adds (8 independent chains per invocation, operands from a uniform so that
nothing folds), written either as `a * b + c` or as `fma(a, b, c)` (override FUSED), and is timed
with GPU timestamps on every runtime given. If a compiler keeps `a * b + c` as two instructions,
the unfused form runs at about half the fused form's rate there. Run on a GPU machine:

    python scripts/experiment_fma.py [--backends wgpu dawn] [--repeat 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _wgsl_variants import register

from paged_sparse_attn.backends.wgpu import _ceilings, _kernels

NAME = "x_fma_chain.wgsl"
ITERS = 1024
WG = 256
SRC = f"""
override FUSED: bool = false;
struct Params {{ x: f32, y: f32, _p0: f32, _p1: f32, }}
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@compute @workgroup_size({WG})
fn main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>) {{
    let i = g.y * n.x * {WG}u + g.x;
    let x = params.x;
    let y = params.y;
    var a0 = f32(i) * 1e-7;
    var a1 = a0 + 0.1;
    var a2 = a0 + 0.2;
    var a3 = a0 + 0.3;
    var a4 = a0 + 0.4;
    var a5 = a0 + 0.5;
    var a6 = a0 + 0.6;
    var a7 = a0 + 0.7;
    for (var k = 0u; k < {ITERS}u; k++) {{
        if (FUSED) {{
            a0 = fma(a0, x, y); a1 = fma(a1, x, y); a2 = fma(a2, x, y); a3 = fma(a3, x, y);
            a4 = fma(a4, x, y); a5 = fma(a5, x, y); a6 = fma(a6, x, y); a7 = fma(a7, x, y);
        }} else {{
            a0 = a0 * x + y; a1 = a1 * x + y; a2 = a2 * x + y; a3 = a3 * x + y;
            a4 = a4 * x + y; a5 = a5 * x + y; a6 = a6 * x + y; a7 = a7 * x + y;
        }}
    }}
    out[i] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
}}
"""

register(NAME, SRC, _kernels.Kernel("uw", trusted=True))


def rate(be, fused: bool, repeat: int, checks: bool = True, gx: int = 4096, gy: int = 4) -> tuple[float, float]:
    """(seconds, FLOP/s) of one dispatch of gx * gy workgroups; ``checks=False`` compiles the kernel
    without runtime checks where the runtime can (wgpu-native's trusted modules: no bounds checks,
    no loop bounding)."""
    from paged_sparse_attn.backends.wgpu._kernels import pipeline

    ctx = be.device_context
    dev = ctx.device
    U = _ceilings.BufferUsage
    n = gx * gy * WG
    ob = dev.create_buffer(size=n * 4, usage=U.STORAGE | U.COPY_SRC)
    pb = dev.create_buffer_with_data(data=np.array([0.999, 1e-3, 0, 0], np.float32), usage=U.UNIFORM)
    pipe, bgl = pipeline(ctx, NAME, {"FUSED": fused}, checks=checks)
    bg = dev.create_bind_group(layout=bgl, entries=[{"binding": 0, "resource": {"buffer": pb}},
                                                    {"binding": 1, "resource": {"buffer": ob}}])
    t, _ = _ceilings.median_time(ctx, _ceilings.one_dispatch(pipe, bg, gx, gy), repeat, 0.2)
    first = np.frombuffer(dev.queue.read_buffer(ob, 0, 16), np.float32)
    ob.destroy()
    pb.destroy()
    if not np.all(np.isfinite(first)):
        raise SystemExit(f"non-finite results {first}")
    return t, 2.0 * 8 * ITERS * n / t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="*", default=["wgpu", "dawn"])
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    from paged_sparse_attn import registry

    for name in a.backends:
        be = registry.get_backend(name)
        for checks in (True, False):
            for fused in (False, True):
                t, r = rate(be, fused, a.repeat, checks)
                print(f"{name:5s} {'fma(a, b, c)' if fused else 'a * b + c   '} runtime checks {'on ' if checks else 'off'}: "
                      f"{t * 1e3:7.3f} ms  {r / 1e12:6.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
