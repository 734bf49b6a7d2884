"""Pinpoint on the device why the earlier tensor-core block scores were wrong.

Run on a machine with Dawn (``wgpudawn``) and a GPU with 16x16x16 f16 subgroup matrices:

    python scripts/diag_sgmat_scores.py [--backend dawn] [--compile-only]

Part 1 runs minimal kernels that each compute C = (Qhi + Qlo) . K^T for 32 rows x 64 positions x
128 dims, with integer keys, integer hi and multiples of 1/256 as lo (every product and sum is
exact in float32, so any difference is a bug). Each kernel changes ONE thing against the recipe
of psa_partials_sgmat.wgsl (which is right on the device): separate workgroup arrays for the
operands, override-sized arrays, a staged step of KD dims (stride KD + 8), accumulators kept
across restaging steps, two operand arrays of the same override-sized type, results stored to a
workgroup array and read back by lanes. For each wrong 16 x 16 tile it prints which known
transform it matches (hi or lo only, hi or lo twice, zero, transpose, another tile, a missing,
lone or doubled step) and the raw tile.

Part 2 runs the block scores themselves on a small problem with integer-valued queries (plus a
1/256 fraction) and keys and scale 1 (exact): the earlier kernel (diag_sgmat_scores_attempt2.wgsl,
its pipeline built directly, with the host's items), the new psa_block_scores_sgmat.wgsl and the
FMA kernel, per (row, block) got against expected.

Each check prints one PASS or FAIL line; the exit status is the number of FAILs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

R, P, D = 32, 64, 128   # rows, positions, dims of part 1
FAILS: list[str] = []


def report(ok: bool, name: str, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILS.append(name)


# --- part 1: minimal kernels -------------------------------------------------------------------

HEAD = """
diagnostic(off, chromium.subgroup_matrix_uniformity);
alias Left = subgroup_matrix_left<f16, 16, 16>;
alias Right = subgroup_matrix_right<f16, 16, 16>;
alias Result = subgroup_matrix_result<f32, 16, 16>;
const R: u32 = 32u;   // rows
const P: u32 = 64u;   // positions
const D: u32 = 128u;  // dims
@group(0) @binding(0) var<storage, read> ga: array<f16>;        // hi [R][D]
@group(0) @binding(1) var<storage, read> gl: array<f16>;        // lo [R][D]
@group(0) @binding(2) var<storage, read> gb: array<f16>;        // keys [P][D]
@group(0) @binding(3) var<storage, read_write> o: array<f32>;   // C [R][P]
"""

# A: the partials recipe. One const-sized array (hi, lo, keys), whole D, stride D + 8, one
# accumulator per tile over all of D, stored straight to storage.
K_ONE_ARRAY = HEAD + """
const HS: u32 = D + 8u;
const LO: u32 = R * HS;
const KO: u32 = 2u * R * HS;
var<workgroup> hmem: array<f16, 17408u>;   // (2 R + P) HS
@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) lid: u32) {
    for (var x = lid; x < R * D; x += 128u) {
        let r = x / D; let d = x - r * D;
        hmem[r * HS + d] = ga[x];
        hmem[LO + r * HS + d] = gl[x];
    }
    for (var x = lid; x < P * D; x += 128u) {
        let p = x / D; let d = x - p * D;
        hmem[KO + p * HS + d] = gb[x];
    }
    workgroupBarrier();
    let sg = lid / 32u;
    let rt = sg % 2u;
    for (var i = 0u; i < 2u; i++) {
        let pt = sg / 2u + 2u * i;
        var acc = Result();
        for (var d0 = 0u; d0 < D; d0 += 16u) {
            let b = subgroupMatrixLoad<Right, col_major>(&hmem, KO + pt * 16u * HS + d0, HS);
            let ah = subgroupMatrixLoad<Left, row_major>(&hmem, rt * 16u * HS + d0, HS);
            let al = subgroupMatrixLoad<Left, row_major>(&hmem, LO + rt * 16u * HS + d0, HS);
            acc = subgroupMatrixMultiplyAccumulate(ah, b, acc);
            acc = subgroupMatrixMultiplyAccumulate(al, b, acc);
        }
        subgroupMatrixStore<row_major>(&o, rt * 16u * P + pt * 16u, acc, P);
    }
}
"""

# B..: the earlier kernels' recipe with one switch each (see VARIANTS). Steps of KD dims staged
# in qh / ql / ks (stride KDP = KD + 8), named accumulators kept across the steps and barriers.
def k_steps(*, arrays: str, store: str, same_type: bool = True, lo: bool = True) -> str:
    """arrays: 'override' (override-sized qh, ql, ks) or 'const' (const-sized, KD = 32 only);
    store: 'storage' (results straight to o) or 'res' (to a workgroup f32 array, lanes copy out);
    same_type False gives ql a length expression of its own (another array type)."""
    if arrays == "override":
        decl = ("override KD: u32 = 32u;\noverride KDP: u32 = KD + 8u;\n"
                "override QLEN: u32 = R * KDP;\n"
                f"override QLEN2: u32 = {'R * KDP' if same_type else 'R * KDP + 8u'};\n"
                "override KLEN: u32 = P * KDP;\n"
                "var<workgroup> qh: array<f16, QLEN>;\n"
                f"var<workgroup> ql: array<f16, {'QLEN' if same_type else 'QLEN2'}>;\n"
                "var<workgroup> ks: array<f16, KLEN>;\n")
    else:
        decl = ("const KD: u32 = 32u;\nconst KDP: u32 = 40u;\n"
                "var<workgroup> qh: array<f16, 1280u>;\n"
                f"var<workgroup> ql: array<f16, {'1280u' if same_type else '1288u'}>;\n"
                "var<workgroup> ks: array<f16, 2560u>;\n")
    if store == "res":
        decl += "override RS: u32 = 36u;\nvar<workgroup> res: array<f32, 4u * 16u * RS>;\n"
        out = """
        subgroupMatrixStore<row_major>(&res, sg * 16u * RS, a0, RS);
        subgroupMatrixStore<row_major>(&res, sg * 16u * RS + 16u, a1, RS);
        workgroupBarrier();
        let lr = (lid % 32u) >> 1u;
        let lc = 16u * ((lid % 32u) & 1u);
        for (var c = 0u; c < 16u; c++) {
            o[(rt * 16u + lr) * P + p0 + lc + c] = res[sg * 16u * RS + lr * RS + lc + c];
        }
"""
    else:
        out = """
        subgroupMatrixStore<row_major>(&o, rt * 16u * P + p0, a0, P);
        subgroupMatrixStore<row_major>(&o, rt * 16u * P + p0 + 16u, a1, P);
"""
    lo_mma = ("a0 = subgroupMatrixMultiplyAccumulate(l, b0, a0);\n"
              "            a1 = subgroupMatrixMultiplyAccumulate(l, b1, a1);") if lo else ""
    return HEAD + decl + """
@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) lid: u32) {
    let sg = lid / 32u;
    let rt = sg % 2u;          // 16-row tile
    let p0 = 32u * (sg / 2u);  // two 16-position tiles
    var a0 = Result();
    var a1 = Result();
    for (var d0 = 0u; d0 < D; d0 += KD) {
        for (var x = lid; x < R * KD; x += 128u) {
            let r = x / KD; let d = x - r * KD;
            qh[r * KDP + d] = ga[r * D + d0 + d];
            ql[r * KDP + d] = gl[r * D + d0 + d];
        }
        for (var x = lid; x < P * KD; x += 128u) {
            let p = x / KD; let d = x - p * KD;
            ks[p * KDP + d] = gb[p * D + d0 + d];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KD; kk += 16u) {
            let h = subgroupMatrixLoad<Left, row_major>(&qh, rt * 16u * KDP + kk, KDP);
            let l = subgroupMatrixLoad<Left, row_major>(&ql, rt * 16u * KDP + kk, KDP);
            let b0 = subgroupMatrixLoad<Right, col_major>(&ks, p0 * KDP + kk, KDP);
            let b1 = subgroupMatrixLoad<Right, col_major>(&ks, (p0 + 16u) * KDP + kk, KDP);
            a0 = subgroupMatrixMultiplyAccumulate(h, b0, a0);
            a1 = subgroupMatrixMultiplyAccumulate(h, b1, a1);
            """ + lo_mma + """
        }
        workgroupBarrier();
    }
    {""" + out + """    }
}
"""


# name, source, override constants, number of staged steps (for the step transforms)
def variants():
    v = [("A one const array (partials recipe), whole D", K_ONE_ARRAY, {}, 1)]
    for kd in (16, 32, 64):
        v.append((f"B override arrays qh/ql/ks (same type), KD={kd}, steps, store to storage",
                  k_steps(arrays="override", store="storage"), {"KD": kd}, D // kd))
    v.append(("C const arrays qh/ql/ks, KD=32, steps, store to storage",
              k_steps(arrays="const", store="storage"), {}, D // 32))
    v.append(("D override arrays, ql of another type, KD=32",
              k_steps(arrays="override", store="storage", same_type=False), {"KD": 32}, D // 32))
    v.append(("E const arrays, ql of another length, KD=32",
              k_steps(arrays="const", store="storage", same_type=False), {}, D // 32))
    v.append(("F override arrays, hi only (no lo product), KD=32",
              k_steps(arrays="override", store="storage", lo=False), {"KD": 32}, D // 32))
    v.append(("G override arrays, KD=32, results via workgroup res + lanes",
              k_steps(arrays="override", store="res"), {"KD": 32}, D // 32))
    return v


def inputs(rng):
    hi = rng.integers(-4, 5, (R, D)).astype(np.float16)
    lo = (rng.integers(-4, 5, (R, D)) / 256.0).astype(np.float16)
    k = rng.integers(-4, 5, (P, D)).astype(np.float16)
    return hi, lo, k


def candidates(hi, lo, k, steps: int, want_lo: bool):
    """Known wrong results, name -> [R, P] float64 (step transforms for `steps` staged steps)."""
    h64, l64, k64 = (x.astype(np.float64) for x in (hi, lo, k))
    q = h64 + l64 if want_lo else h64
    c = {"hi only": h64 @ k64.T, "lo only": l64 @ k64.T, "hi twice (lo read from hi)": 2 * h64 @ k64.T,
         "lo twice (hi read from lo)": 2 * l64 @ k64.T, "hi + lo": (h64 + l64) @ k64.T}
    kd = D // steps
    if steps > 1:
        for s in range(steps):
            m = np.zeros(D)
            m[s * kd:(s + 1) * kd] = 1.0
            part = (q * m) @ k64.T
            full = q @ k64.T
            c[f"step {s} missing"] = full - part
            c[f"only step {s}"] = part
            c[f"step {s} doubled"] = full + part
        c["last step only"] = c[f"only step {steps - 1}"]
    # chunks of 16 dims: one missing / alone
    for j in range(D // 16):
        m = np.zeros(D)
        m[16 * j:16 * j + 16] = 1.0
        c[f"16-dim chunk {j} only"] = (q * m) @ k64.T
    return c


def classify(got, want, cands, rt, pt):
    """Name of the transform the 16 x 16 tile (rt, pt) of `got` matches."""
    g = got[16 * rt:16 * rt + 16, 16 * pt:16 * pt + 16]
    w = want[16 * rt:16 * rt + 16, 16 * pt:16 * pt + 16]
    if np.array_equal(g, w):
        return "exact"
    if not np.any(g):
        return "zero"
    if np.array_equal(g, w.T):
        return "transposed"
    if np.array_equal(g, -w):
        return "negated"
    for name, cm in cands.items():
        if np.array_equal(g, cm[16 * rt:16 * rt + 16, 16 * pt:16 * pt + 16]):
            return name
    for r2 in range(R // 16):
        for p2 in range(P // 16):
            t = want[16 * r2:16 * r2 + 16, 16 * p2:16 * p2 + 16]
            if (r2, p2) != (rt, pt) and np.array_equal(g, t):
                return f"the tile of rows {16 * r2}.. positions {16 * p2}.."
            if np.array_equal(g, t.T):
                return f"the transposed tile of rows {16 * r2}.. positions {16 * p2}.."
    # row / column shifts within the whole result
    for dr in range(-15, 16):
        for dc in range(-15, 16):
            r0, c0 = 16 * rt + dr, 16 * pt + dc
            if (dr or dc) and 0 <= r0 <= R - 16 and 0 <= c0 <= P - 16 and np.array_equal(
                    g, want[r0:r0 + 16, c0:c0 + 16]):
                return f"shifted by {dr} rows, {dc} positions"
    # per-row or per-column matches
    rows = [next((f"row {j}" for j in range(R) if np.array_equal(g[i], want[j, 16 * pt:16 * pt + 16])), "?")
            for i in range(16)]
    if "?" not in rows:
        return "rows permuted: " + ", ".join(rows)
    return "no known transform"


def run_kernel(dev, wgpu_mod, src, consts, hi, lo, k):
    U = wgpu_mod.BufferUsage
    sm = dev.create_shader_module(code=src)
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": sm, "entry_point": "main",
                                                                "constants": consts})
    bufs = [dev.create_buffer_with_data(data=np.ascontiguousarray(x), usage=U.STORAGE) for x in (hi, lo, k)]
    ob = dev.create_buffer_with_data(data=np.full(R * P, np.nan, np.float32), usage=U.STORAGE | U.COPY_SRC)
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": i, "resource": {"buffer": b}} for i, b in enumerate(bufs + [ob])])
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, bg)
    cp.dispatch_workgroups(1, 1, 1)
    cp.end()
    dev.queue.submit([enc.finish()])
    got = np.frombuffer(dev.queue.read_buffer(ob), np.float32).reshape(R, P).astype(np.float64)
    for b in bufs + [ob]:
        b.destroy()
    return got


def part1(dev, wgpu_mod, prefix: str, compile_only: bool) -> None:
    rng = np.random.default_rng(7)
    hi, lo, k = inputs(rng)
    for name, body, consts, steps in variants():
        src = prefix + body
        if compile_only:
            try:
                dev.create_shader_module(code=src)
                report(True, f"compiles: {name}")
            except Exception as exc:  # noqa: BLE001 -- Tint's message is the result
                report(False, f"compiles: {name}", str(exc).splitlines()[0])
            continue
        want_lo = "hi only" not in name
        try:
            got = run_kernel(dev, wgpu_mod, src, consts, hi, lo, k)
        except Exception as exc:  # noqa: BLE001 -- report and go on with the next variant
            report(False, f"[1] {name}", f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        h64, l64, k64 = (x.astype(np.float64) for x in (hi, lo, k))
        want = ((h64 + l64) if want_lo else h64) @ k64.T
        cands = candidates(hi, lo, k, steps, want_lo)
        err = np.abs(got - want)
        tiles = {(rt, pt): classify(got, want, cands, rt, pt) for rt in range(R // 16) for pt in range(P // 16)}
        bad = {t: c for t, c in tiles.items() if c != "exact"}
        report(not bad, f"[1] {name}", f"max |err| {np.nanmax(err):.4g}, NaN {int(np.isnan(got).sum())}; "
               + ("all 8 tiles exact" if not bad else
                  "; ".join(f"tile (rows {16 * a}.., pos {16 * b}..) = {c}" for (a, b), c in bad.items())))
        for (a, b), c in list(bad.items())[:2]:
            g = got[16 * a:16 * a + 4, 16 * b:16 * b + 8]
            w = want[16 * a:16 * a + 4, 16 * b:16 * b + 8]
            print(f"     tile ({a},{b}) got[:4,:8]\n{np.array2string(g, precision=4, max_line_width=160)}\n"
                  f"     want[:4,:8]\n{np.array2string(w, precision=4, max_line_width=160)}", flush=True)


# --- part 2: the block scores on a small exact problem -----------------------------------------

def exact_problem(rng, T, L, *, Hkv=4, d=128, S=64, BS=128):
    B = len(T)
    maxp = max(-(-max(L) // S), 1)
    maxp += (-maxp) % (BS // S)
    P_ = B * maxp + 1
    bt = np.full((B, maxp), -1, np.int32)
    perm = rng.permutation(P_)
    for b in range(B):
        for j in range(-(-L[b] // S)):
            bt[b, j] = perm[b * maxp + j]
    ik = rng.integers(-4, 5, (P_, 1, S, d)).astype(np.float16)
    iq = (rng.integers(-4, 5, (sum(T), Hkv, d)) + rng.integers(-4, 5, (sum(T), Hkv, d)) / 256.0).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)
    return (iq, ik, bt, cu, np.asarray(L, np.int32)), BS


def attempt2_kd(dims: int, rt: int, storage: int) -> int:
    """KD the earlier host chose (its workgroup-memory rule: staged hi, lo, keys, results)."""
    dp = -(-dims // 16) * 16
    for kd in (64, 32, 16):
        if kd > dp and kd != 16:
            continue
        kdp, mp = kd + 8, (4 if rt >= 32 else 2)
        a = lambda n: -(-n // 16) * 16  # noqa: E731
        if 2 * a(2 * rt * kdp) + a(2 * 128 * kdp) + a(4 * 4 * 16 * (16 * mp + 4)) + a(512) + 6 * a(4 * rt) + 48 <= storage:
            return kd
    return 16


def part2(be) -> None:
    from paged_sparse_attn.backends.wgpu import _index_branch as ib
    from paged_sparse_attn.backends.wgpu._kernels import _layout
    from paged_sparse_attn.index_branch import block_scores
    from paged_sparse_attn.index_branch.reference import block_scores_reference

    ctx = be._device()
    old_src = (HERE / "diag_sgmat_scores_attempt2.wgsl").read_text()
    prefix = ctx.runtime.subgroup_directive + "enable f16;\nenable chromium_experimental_subgroup_matrix;\n"
    orig = be._ib_pipeline
    used: list[str] = []
    mode = {"old": False}

    def spy(kernel, f16, constants):
        if kernel == ib.SCORES_SGMAT and mode["old"]:
            # the earlier kernel with the constants its host passed (RT, SR, KD: its geometry rule)
            rt = constants["RT"]
            c = {"DV": constants["DV"], "S": constants["S"], "BS": constants["BS"], "RT": rt,
                 "SR": 2 if rt >= 32 else 1, "KD": attempt2_kd(4 * constants["DV"], rt, ctx.workgroup_storage)}
            used.append(f"attempt2{c}")
            bgl, pl = _layout(ctx, ib.SCORES_SGMAT)  # the same bindings
            sm = ctx.device.create_shader_module(code=prefix + old_src)
            pipe = ctx.device.create_compute_pipeline(layout=pl, compute={"module": sm, "entry_point": "main",
                                                                          "constants": c})
            return pipe, bgl
        used.append(f"{kernel}{dict(constants)}")
        return orig(kernel, f16, constants)

    def run(tag, choice, old, args, bs):
        used.clear()
        be._scores_kernel = choice
        mode["old"] = old
        try:
            got = np.asarray(block_scores(*args, block_size=bs, causal=True, softmax_scale=1.0, backend=be))
        finally:
            be._scores_kernel = "auto"
            mode["old"] = False
        return got, list(used)

    be._ib_pipeline = spy
    try:
        rng = np.random.default_rng(11)
        cases = [("T=[20] L=[300] Hkv=4 (80 rows: 64 + 16)", exact_problem(rng, [20], [300])),
                 ("T=[3] L=[200] Hkv=4 d=16 (12 rows, RT=16)", exact_problem(rng, [3], [200], d=16)),
                 ("T=[9,7] L=[129,400] Hkv=4 d=40 (RT=64)", exact_problem(rng, [9, 7], [129, 400], d=40))]
        for cname, (args, bs) in cases:
            ref = block_scores_reference(*args, block_size=bs, causal=True, softmax_scale=1.0)
            for tag, choice, old in (("FMA", "fma", False), ("attempt 2", "sgmat", True), ("attempt 3", "sgmat", False)):
                try:
                    got, k = run(tag, choice, old, args, bs)
                except Exception as exc:  # noqa: BLE001 -- report and go on
                    report(False, f"[2] {tag} {cname}", f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                    continue
                fin = np.isfinite(ref)
                same_inf = np.array_equal(np.isneginf(got), np.isneginf(ref))
                diff = np.abs(np.where(fin, got, 0) - np.where(fin, ref, 0))
                report(same_inf and diff.max() == 0, f"[2] {tag} {cname}",
                       f"kernel {k[-1] if k else '?'}; max |got - want| {diff.max():.4g}, -inf pattern "
                       f"{'ok' if same_inf else 'DIFFERS'}")
                bad = np.argwhere(diff > 0)
                for t, h, s in bad[:8]:
                    print(f"     (t={t}, h={h}, block {s}): got {got[t, h, s]:.6g} want {ref[t, h, s]:.6g} "
                          f"ratio {got[t, h, s] / ref[t, h, s] if ref[t, h, s] else float('nan'):.4g}")
    finally:
        be._ib_pipeline = orig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile part 1's kernels on Dawn's Null adapter (no GPU) and stop")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.compile_only:
        from paged_sparse_attn.backends.wgpu._runtime import DAWN
        from paged_sparse_attn.backends.wgpu._shader_check import null_device
        import wgpudawn
        part1(null_device(), wgpudawn, DAWN.subgroup_directive +
              "enable f16;\nenable chromium_experimental_subgroup_matrix;\n", True)
        return len(FAILS)
    from paged_sparse_attn import registry
    be = registry.get_backend(a.backend)
    ctx = be._device()
    print(f"device: {ctx.summary}; sgmat {sorted(ctx.sgmat)}; subgroup {ctx.subgroup}; "
          f"workgroup memory {ctx.workgroup_storage} B", flush=True)
    import importlib
    wgpu_mod = importlib.import_module(ctx.runtime.module)
    prefix = ctx.runtime.subgroup_directive + "enable f16;\nenable chromium_experimental_subgroup_matrix;\n"
    part1(ctx.device, wgpu_mod, prefix, False)
    print(f"(part 1 done at {time.perf_counter() - t0:.1f} s)", flush=True)
    part2(be)
    print(f"{len(FAILS)} FAIL(s){': ' + '; '.join(FAILS) if FAILS else ''}; {time.perf_counter() - t0:.1f} s")
    return len(FAILS)


if __name__ == "__main__":
    sys.exit(main())
