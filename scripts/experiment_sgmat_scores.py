"""Variants of the tensor-core block scores (psa_block_scores_sgmat.wgsl): correct, and how fast.

Run on a machine with Dawn (the ``wgpudawn`` package) and a GPU with f16 subgroup matrices:

    python scripts/experiment_sgmat_scores.py [--backend dawn] [--repeat 10] [--variants NT,IPW ...]

For each variant (the kernel's override constants NT, 16-position tiles per step, and IPW, work
items per workgroup) it checks the block scores of a few small problems against the float64 loop
reference with the bound of R22 and exact -inf / +inf / NaN patterns (unmapped pages, poisoned
tails, causal and not, NaN / inf / huge / tiny queries, NaN / inf keys in the causal future, a
16-row tile with page 16 and block 64), the prefill shape (Tq = 4096, L = 32k, Hkv = 4, d_idx =
128, block 128, page 64, float16 keys) against the numpy backend (twice the bound) and two runs
against each other (R19), then times the block-score pass of the prefill shape with GPU
timestamps. The FMA kernel (psa_block_scores.wgsl) is timed in the same run. One line per
variant: PASS or FAIL, the largest error / bound ratio, the median time; the exit status is the
number of failing variants.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_sgmat_scores as chk

from paged_sparse_attn import registry
from paged_sparse_attn._index import query_positions
from paged_sparse_attn.backends.wgpu import _index_branch as ib
from paged_sparse_attn.index_branch import block_scores
from paged_sparse_attn.index_branch.reference import block_scores_reference

VARIANTS = [(1, 1), (1, 8), (2, 1), (2, 4), (2, 8), (2, 16), (4, 8), (1, 16)]


def small_problems(rng):
    """(name, problem, scale, causal) of the small checks."""
    out = []
    p = chk.problem(rng, [70, 33], [700, 301], Hkv=2, unmapped=0.2)
    out += [("T=[70,33] L=[700,301] holes, causal", p, None, True), ("same, causal=False", p, None, False),
            ("same, scale=-1", p, -1.0, True)]
    p = chk.problem(rng, [40, 30], [600, 500], Hkv=2)
    iq = p["index_q"]
    iq[3, 0, 5] = np.nan
    iq[10, 1, 7] = np.inf
    iq[11, 0, 9] = -np.inf
    iq[45, 0] = 0.0
    iq[20:25] *= np.float32(1e6)
    iq[50:55] *= np.float32(1e-6)
    iq[56, 1] *= np.float32(1e-30)
    iq[57, 1, 3] = np.float32(1e-7)
    iq[59, 1, 2] = np.float32(1e-41)
    out += [("NaN/inf/huge/tiny/zero queries", p, None, True), ("same, scale=0", p, 0.0, False)]
    p = chk.problem(rng, [40, 30], [600, 500], Hkv=2)
    ik, bt, S = p["index_k_cache"], p["block_tables"], 64
    for b, (pos, val) in enumerate([(590, np.inf), (480, np.nan)]):
        ik[bt[b, pos // S], 0, pos % S, 11] = val
    ik[bt[0, 3], 0, 5, 0] = -np.inf  # a visible -inf key
    out += [("inf/NaN keys in the causal future", p, None, True), ("same, causal=False", p, None, False)]
    p = chk.problem(rng, [3, 2, 5], [513, 64, 900], Hkv=4, S=16, BS=64, unmapped=0.2)
    out.append(("rows/seq 20 (RT=32), page 16, block 64", p, None, True))
    p = chk.problem(rng, [40, 9], [1500, 200], Hkv=3, Hk=3, d=64, unmapped=0.3)
    out.append(("Hk_idx=Hkv=3, d_idx=64", p, None, True))
    p = chk.problem(rng, [300], [1000], Hkv=4)
    out.append(("T=300 L=1000 (several row runs)", p, None, True))
    return out


def ratio_and_patterns(got, ref, bound):
    """(max err / bound over finite reference entries, special-value patterns equal)."""
    got = np.asarray(got)
    same = (got.shape == ref.shape and np.array_equal(np.isneginf(got), np.isneginf(ref))
            and np.array_equal(np.isposinf(got), np.isposinf(ref)) and np.array_equal(np.isnan(got), np.isnan(ref)))
    fin = np.isfinite(ref)
    err = np.abs(got[fin].astype(np.float64) - ref[fin])
    return (float((err / bound[fin]).max()) if err.size else 0.0), same


def gpu_time(be, p, repeat: int) -> float:
    """Median GPU time (s) of the block-score dispatches of ``p`` (timestamps around one pass)."""
    return chk.gpu_time(be, p, repeat)[0]


class Prefill:
    """The prefill shape, its exact scores on a sample of rows and a cheap bound for every row.

    The float64 reference of every row would take longer than the whole budget of the script, so
    ``ref`` / ``bound`` (R22's bound, against float64) cover SAMPLE queries x every head, and every
    row is compared with the FMA kernel's scores of the same run within ``2 * loose`` (R22's
    formula with max_p |q| . |k_p| replaced by |q| . max_p |k_p|, an upper bound)."""

    SAMPLE = 64

    def __init__(self, T: int = 4096, L: int = 32768):
        self.p = p = chk.problem(np.random.default_rng(0), [T], [L], Hkv=4, poison=False)
        self.scale = 1.0 / np.sqrt(128.0)
        iq, ik, bt = p["index_q"], p["index_k_cache"], p["block_tables"]
        BS, d = p["block_size"], iq.shape[2]
        K = ik[bt[0, :L // 64], 0].reshape(L, d).astype(np.float64)  # positions 0 .. L-1
        _, hi = query_positions(p["cu_seqlens_q"], p["used_kv_lens"], True)
        rng = np.random.default_rng(5)
        self.ts = np.unique(np.concatenate([[0, 1, T // 2, T - 1], rng.integers(0, T, self.SAMPLE - 4)]))
        q = iq[self.ts].astype(np.float64)  # [n, H, d]
        vis = np.arange(L)[None, :] < hi[self.ts][:, None]  # [n, L]
        eps = float(np.finfo(np.float32).eps)
        n, H = q.shape[:2]
        z = (q.reshape(n * H, d) @ K.T).reshape(n, H, L) * self.scale
        m = (np.abs(q).reshape(n * H, d) @ np.abs(K).T).reshape(n, H, L) * self.scale
        z = np.where(vis[:, None, :], z, -np.inf).reshape(*z.shape[:2], L // BS, BS)
        m = np.where(vis[:, None, :], m, 0.0).reshape(*m.shape[:2], L // BS, BS)
        self.ref = z.max(axis=-1)
        self.bound = (d + 2) * eps * m.max(axis=-1) + np.finfo(np.float32).tiny
        kmax = np.abs(K).max(axis=0)  # [d]
        self.loose = ((d + 2) * eps * self.scale * (np.abs(iq).astype(np.float64) @ kmax)[:, :, None]
                      + np.finfo(np.float32).tiny)
        self.fma = None  # the FMA kernel's scores, set by the first run

    def check(self, got) -> tuple[float, list[str]]:
        bad = []
        r, same = ratio_and_patterns(got[self.ts], self.ref, self.bound)
        if not same or r > 1.0:
            bad.append(f"prefill sample vs float64 (ratio {r:.3g}, patterns {'ok' if same else 'DIFFER'})")
        if self.fma is not None:
            r2, same2 = ratio_and_patterns(got, self.fma, 2.0 * np.broadcast_to(self.loose, got.shape))
            if not same2 or r2 > 1.0:
                bad.append(f"prefill vs FMA kernel (ratio {r2:.3g} of the loose bound, patterns "
                           f"{'ok' if same2 else 'DIFFER'})")
        return r, bad


def run_variant(be, name, smalls, refs, pre: Prefill, repeat, want) -> tuple[bool, str]:
    """Checks and timing of the kernel the backend now picks; (all passed, one line)."""
    worst, bad = 0.0, []
    for (pname, p, scale, causal), (ref, bound) in zip(smalls, refs):
        chk.USED.clear()
        got = block_scores(*chk.args_of(p), block_size=p["block_size"], causal=causal, softmax_scale=scale,
                           backend=be)
        r, same = ratio_and_patterns(got, ref, bound)
        worst = max(worst, r)
        if not same or r > 1.0 or not any(want in u for u in chk.USED):
            bad.append(f"{pname} (ratio {r:.3g}, patterns {'ok' if same else 'DIFFER'}, ran {chk.USED[-1:]})")
    chk.USED.clear()
    kw = dict(block_size=pre.p["block_size"], causal=True, softmax_scale=pre.scale)
    got = np.asarray(block_scores(*chk.args_of(pre.p), **kw, backend=be))
    ran = chk.USED[-1] if chk.USED else "?"
    if want not in ran:
        bad.append(f"prefill ran {ran}")
    r_pre, why = pre.check(got)
    bad += why
    if pre.fma is None:
        pre.fma = got
    again = np.asarray(block_scores(*chk.args_of(pre.p), **kw, backend=be))
    if again.tobytes() != got.tobytes():
        bad.append("prefill: two runs differ (R19)")
    t = gpu_time(be, pre.p, repeat)
    ok = not bad
    line = (f"{'PASS' if ok else 'FAIL'} {name:22s} {t * 1e3:8.3f} ms  small max err/bound {worst:.3g}, prefill "
            f"sample {r_pre:.3g}  [{ran}]" + ("" if ok else "  FAILED: " + "; ".join(bad)))
    return ok, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--variants", nargs="*", default=None, help="NT,IPW pairs (default: the built-in list)")
    ap.add_argument("--prefill", nargs=2, type=int, default=(4096, 32768), metavar=("TQ", "L"),
                    help="the timed shape's queries and cached positions (default 4096 32768)")
    a = ap.parse_args()
    variants = [tuple(int(x) for x in v.split(",")) for v in a.variants] if a.variants else VARIANTS
    t0 = time.perf_counter()
    be = registry.get_backend(a.backend)
    ctx = be._device()
    chk.spy_kernels(be)
    print(f"device: {getattr(ctx, 'summary', '?')}; runtime {getattr(ctx, 'runtime', '?')}; sgmat "
          f"{sorted(getattr(ctx, 'sgmat', ()))}; subgroup {getattr(ctx, 'subgroup', '?')}; workgroup memory "
          f"{ctx.workgroup_storage} B", flush=True)
    rng = np.random.default_rng(1234)
    smalls = small_problems(rng)
    refs = []
    for _, p, scale, causal in smalls:
        kw = dict(block_size=p["block_size"], causal=causal, softmax_scale=scale)
        refs.append((block_scores_reference(*chk.args_of(p), **kw), chk.bound_of(p, scale, causal)))
    pre = Prefill(*a.prefill)
    print(f"(references ready at {time.perf_counter() - t0:.1f} s)", flush=True)

    orig = (ib.SGMAT_SCORES_NT, ib.SGMAT_SCORES_IPW)
    fails = 0
    be._scores_kernel = "fma"
    ok, line = run_variant(be, "FMA kernel", smalls, refs, pre, a.repeat, "scores{")
    print(line, flush=True)
    fails += not ok
    be._scores_kernel = "sgmat"
    try:
        for nt, ipw in variants:
            ib.SGMAT_SCORES_NT, ib.SGMAT_SCORES_IPW = nt, ipw
            name = f"sgmat NT={nt} IPW={ipw}" + (" (default)" if (nt, ipw) == orig else "")
            try:
                ok, line = run_variant(be, name, smalls, refs, pre, a.repeat, "scores_sgmat")
            except Exception as exc:  # noqa: BLE001 -- report the variant, go on with the next
                ok, line = False, f"FAIL {name:22s} {type(exc).__name__}: {str(exc)[:300]}"
            print(line + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
            fails += not ok
    finally:
        ib.SGMAT_SCORES_NT, ib.SGMAT_SCORES_IPW = orig
        be._scores_kernel = "auto"
    print(f"{fails} failing variant(s); {time.perf_counter() - t0:.1f} s")
    return fails


if __name__ == "__main__":
    sys.exit(main())
