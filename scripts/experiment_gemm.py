"""Experiment: which way of writing a subgroup-matrix GEMM in WGSL feeds the tensor cores best.

Not a kernel of the library: this script writes WGSL variants of the matmul ceiling's kernels
(``psa_gemm_sgmat.wgsl``, ``psa_gemm_sgmat_tiled.wgsl``) with every loop over tiles written out
and every result matrix in its own variable instead of a function-scope array indexed in loops,
registers them beside the real kernels for this process only, and times and checks them with the
ceiling's own harness (:func:`paged_sparse_attn.backends.wgpu._ceilings.matmul_variants`), on
Dawn with and without its bounds checks. Run on a machine with Dawn and f16 subgroup matrices:

    python scripts/experiment_gemm.py [--size 4096] [--repeat 10]

Each line: PASS / FAIL against the bound of f32 accumulation, the rate and the time.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _wgsl_variants import register

from paged_sparse_attn.backends.wgpu import _ceilings, _kernels


def _register(name: str, src: str) -> str:
    return register(name, src, _kernels.Kernel("urrw", sgmat=True))

HEAD = """
struct Params {
    m: u32,
    n: u32,
    k: u32,
    _pad: u32,
}
alias Left = subgroup_matrix_left<f16, 16, 16>;
alias Right = subgroup_matrix_right<f16, 16, 16>;
alias Result = subgroup_matrix_result<f32, 16, 16>;
@group(0) @binding(0) var<uniform> params: Params;
"""


def direct(tm: int, tn: int) -> str:
    """One subgroup per (16 tm) x (16 tn) block of C, operands loaded from storage."""
    L = [HEAD,
         "@group(0) @binding(1) var<storage, read> a: array<f16>;",
         "@group(0) @binding(2) var<storage, read> b: array<f16>;",
         "@group(0) @binding(3) var<storage, read_write> c: array<f32>;",
         "@compute @workgroup_size(32)",
         "fn main(@builtin(workgroup_id) wid: vec3<u32>) {",
         "    let n = params.n;", "    let k_len = params.k;",
         f"    let row0 = wid.y * {16 * tm}u;", f"    let col0 = wid.x * {16 * tn}u;"]
    L += [f"    var acc{i}{j}: Result;" for i in range(tm) for j in range(tn)]
    L.append("    for (var k0 = 0u; k0 < k_len; k0 += 16u) {")
    L += [f"        let r{j} = subgroupMatrixLoad<Right>(&b, k0 * n + col0 + {16 * j}u, false, n);" for j in range(tn)]
    for i in range(tm):
        L.append(f"        let l{i} = subgroupMatrixLoad<Left>(&a, (row0 + {16 * i}u) * k_len + k0, false, k_len);")
        L += [f"        acc{i}{j} = subgroupMatrixMultiplyAccumulate(l{i}, r{j}, acc{i}{j});" for j in range(tn)]
    L.append("    }")
    L += [f"    subgroupMatrixStore(&c, (row0 + {16 * i}u) * n + col0 + {16 * j}u, acc{i}{j}, false, n);"
          for i in range(tm) for j in range(tn)]
    L.append("}")
    return "\n".join(L) + "\n"


def tiled(sgm: int, sgn: int, tm: int, tn: int, bk: int, stages: int, pad: int = 8) -> str:
    """The tiled kernel's algorithm with every tile loop written out and one variable per matrix."""
    wg = 32 * sgm * sgn
    bm, bn = 16 * tm * sgm, 16 * tn * sgn
    sa_, sb_ = bk + pad, bn + pad
    a_stage, b_stage = bm * sa_, bk * sb_
    a_ru, b_ru = bk // 8, bn // 8
    a_units, b_units = bm * a_ru // wg, bk * b_ru // wg
    assert a_units * wg == bm * a_ru and b_units * wg == bk * b_ru and a_units >= 1 and b_units >= 1
    L = [HEAD,
         "@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;",
         "@group(0) @binding(2) var<storage, read> b: array<vec4<u32>>;",
         "@group(0) @binding(3) var<storage, read_write> c: array<f32>;",
         f"var<workgroup> sa: array<f16, {stages * a_stage}>;",
         f"var<workgroup> sb: array<f16, {stages * b_stage}>;"]
    for nm in ("a", "b"):
        L.append(f"fn put_{nm}(base: u32, u: vec4<u32>) {{")
        for w, comp in enumerate("xyzw"):
            L.append(f"    let h{w} = bitcast<vec2<f16>>(u.{comp});")
            L.append(f"    s{nm}[base + {2 * w}u] = h{w}.x;")
            L.append(f"    s{nm}[base + {2 * w + 1}u] = h{w}.y;")
        L.append("}")
    L += [f"@compute @workgroup_size({wg})",
          "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,",
          "        @builtin(subgroup_id) sg: u32) {",
          "    let n = params.n;", "    let k_len = params.k;", "    let kq = k_len / 8u;", "    let nq = n / 8u;",
          f"    let row0 = wid.y * {bm}u;", f"    let col0 = wid.x * {bn}u;",
          f"    let srow = (sg / {sgn}u) * {16 * tm}u;", f"    let scol = (sg % {sgn}u) * {16 * tn}u;",
          f"    let steps = k_len / {bk}u;"]
    L += [f"    var acc{i}{j}: Result;" for i in range(tm) for j in range(tn)]
    L += [f"    var ra{u}: vec4<u32>;" for u in range(a_units)] + [f"    var rb{u}: vec4<u32>;" for u in range(b_units)]

    # per operand: name, units per invocation, units per staged row, source unit, stage, row stride
    ops = (("a", a_units, a_ru, "(row0 + u / {ru}u) * kq + {kn} / 8u + u % {ru}u", a_stage, sa_),
           ("b", b_units, b_ru, "({kn} + u / {ru}u) * nq + col0 / 8u + u % {ru}u", b_stage, sb_))

    def loads(kn: str, ind: str) -> list[str]:
        return [f"{ind}{{ let u = {u * wg}u + lid; r{nm}{u} = {nm}[{src.format(ru=ru, kn=kn)}]; }}"
                for nm, units, ru, src, _, _ in ops for u in range(units)]

    def puts(stage: str, ind: str) -> list[str]:
        return [f"{ind}{{ let u = {u * wg}u + lid; put_{nm}({stage} * {st}u + (u / {ru}u) * {stride}u + "
                f"(u % {ru}u) * 8u, r{nm}{u}); }}" for nm, units, ru, _, st, stride in ops for u in range(units)]

    L += loads("0u", "    ") + puts("0u", "    ") + ["    workgroupBarrier();"]
    L.append("    for (var t = 0u; t < steps; t++) {")
    L.append("        let more = t + 1u < steps;")
    L.append("        if (more) {")
    L += loads(f"(t + 1u) * {bk}u", "            ")
    L.append("        }")
    L.append(f"        let sa0 = (t % {stages}u) * {a_stage}u + srow * {sa_}u;")
    L.append(f"        let sb0 = (t % {stages}u) * {b_stage}u + scol;")
    for kk in range(0, bk, 16):
        L += [f"        let r{j}_{kk} = subgroupMatrixLoad<Right, row_major>(&sb, sb0 + {kk * sb_ + 16 * j}u, {sb_}u);"
              for j in range(tn)]
        for i in range(tm):
            L.append(f"        let l{i}_{kk} = subgroupMatrixLoad<Left, row_major>(&sa, sa0 + {16 * i * sa_ + kk}u, {sa_}u);")
            L += [f"        acc{i}{j} = subgroupMatrixMultiplyAccumulate(l{i}_{kk}, r{j}_{kk}, acc{i}{j});" for j in range(tn)]
    L.append("        if (more) {")
    if stages == 1:
        L.append("            workgroupBarrier();")
    L += puts(f"((t + 1u) % {stages}u)", "            ")
    L.append("        }")
    L.append("        workgroupBarrier();")
    L.append("    }")
    L.append("    let c0 = (row0 + srow) * n + col0 + scol;")
    L += [f"    subgroupMatrixStore<row_major>(&c, c0 + {16 * i}u * n + {16 * j}u, acc{i}{j}, n);"
          for i in range(tm) for j in range(tn)]
    L.append("}")
    return "\n".join(L) + "\n"


@dataclass(frozen=True)
class X:
    """A generated variant, shaped like ``_ceilings.GemmVariant`` for ``matmul_variants``."""

    name: str
    kernel: str
    block: tuple
    invocations: int
    workgroup_bytes: int
    constants: tuple = ()

    @property
    def c(self) -> dict:
        return {}

    def unfit(self, ctx, m, n, k):
        bm, bn, bk = self.block
        if m % bm or n % bn or k % bk:
            return f"shape not a multiple of {self.block}"
        if self.workgroup_bytes > ctx.workgroup_storage:
            return f"needs {self.workgroup_bytes} B of workgroup memory"
        return None


def variants() -> list:
    out = []
    for tm, tn in ((2, 2), (4, 2), (4, 4), (2, 4)):
        nm = _register(f"x_direct_{tm}{tn}.wgsl", direct(tm, tn))
        out.append(X(f"direct-x TM={tm} TN={tn}", nm, (16 * tm, 16 * tn, 16), 32, 0))
    for sgm, sgn, tm, tn, bk, st in ((2, 2, 2, 2, 32, 2), (2, 2, 4, 4, 32, 2), (2, 4, 4, 2, 32, 2),
                                     (4, 2, 2, 4, 32, 2), (2, 2, 4, 2, 32, 2), (2, 2, 2, 4, 32, 2),
                                     (2, 2, 4, 4, 16, 2), (2, 4, 4, 4, 16, 2), (2, 2, 2, 2, 64, 2)):
        nm = _register(f"x_tiled_{sgm}{sgn}{tm}{tn}{bk}{st}.wgsl", tiled(sgm, sgn, tm, tn, bk, st))
        bm, bn = 16 * tm * sgm, 16 * tn * sgn
        wb = 2 * st * (bm * (bk + 8) + bk * (bn + 8))
        out.append(X(f"tiled-x SGM={sgm} SGN={sgn} TM={tm} TN={tn} BK={bk} STAGES={st}", nm, (bm, bn, bk),
                     32 * sgm * sgn, wb))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--only", default="", help="substring: run only variants whose name holds it")
    ap.add_argument("--file-kernels", action="store_true", help="also the ceiling's own variants (GEMM_VARIANTS)")
    ap.add_argument("--robustness", choices=("both", "on", "off"), default="both")
    a = ap.parse_args()
    from paged_sparse_attn.backends.wgpu.backend import DawnBackend

    vs = [v for v in variants() if a.only in v.name]
    base = list(_ceilings.GEMM_VARIANTS) if a.file_kernels else []
    fails = 0
    for robust in {"both": (True, False), "on": (True,), "off": (False,)}[a.robustness]:
        t0 = time.perf_counter()
        be = DawnBackend(robustness=robust)
        ctx = be.device_context
        print(f"== dawn robustness={robust}: {ctx.summary}", flush=True)
        for what, m, reps in (("512x768x1024", (512, 768, 1024), 1), (f"{a.size}^3", (a.size,) * 3, a.repeat)):
            rows = _ceilings.matmul_variants(ctx, *m, repeat=reps, variants=tuple(base) + tuple(vs), seed=1)
            for r in rows:
                if r["skipped"]:
                    print(f"SKIP {what} {r['name']}: {r['skipped']}", flush=True)
                    continue
                fails += not r["ok"]
                print(f"{'PASS' if r['ok'] else 'FAIL'} {what} {r['name']}: {r['flop_per_s'] / 1e12:7.1f} TFLOP/s "
                      f"{r['gemm_s'] * 1e3:8.3f} ms  err {r['max_abs_err']:.3g} (bound {r['err_bound']:.3g})",
                      flush=True)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    try:
        import torch

        if torch.cuda.is_available():
            from paged_sparse_attn.bench.peers import matmul_rate as torch_rate

            print(f"torch bf16 matmul {a.size}^3: {torch_rate(a.size) / 1e12:.1f} TFLOP/s", flush=True)
    except ImportError:
        pass
    return fails


if __name__ == "__main__":
    raise SystemExit(main())
