"""Check and time variants of the subgroup-matrix partials kernel against each other on a GPU.

Variants (the host default stays ``psa_partials_sgmat.wgsl``; this script flips
``_sgmat.VARIANT`` / ``_sgmat.VARIANT_WG`` per variant, on fresh backend instances):

- ``sgmat``: ``psa_partials_sgmat.wgsl`` as the host picks it (K/V tiles staged in workgroup memory);
- ``sgmat2-wg128`` / ``sgmat2-wg64``: ``psa_partials_sgmat2.wgsl`` (K and V loaded as subgroup
  matrices straight from storage, the whole block's scores and P at once, no barrier between
  tiles) with 4 or 2 subgroups per workgroup (32-row items with 4, 16-row items with 2: 41 KB
  and 39 KB of workgroup memory, one workgroup per SM);
- ``sgmat2r16-wg128`` / ``sgmat2r16-wg64``: the same kernel with capacities for 16-row items
  (``psa_partials_sgmat2_r16.wgsl``, 23 KB: two workgroups per SM; twice the work items, each
  block's K/V read by two).

For each variant, the small adversarial problems of ``check_sgmat_partials.py`` (its functions:
R20 bounds against the float64 reference, NaN / +-inf where the reference has them and equal to
the FMA kernel's pattern), one of them with NHD caches (R34), and ``forward_partials`` against the
per-edge oracle; then the prefill workload (B=1, L=32k, last 4096 queries, causal, Hq=32, Hkv=4,
D=128, top-16 of 128-position blocks, page 64, float16 caches, device-resident): the last 64
queries against the reference, every query against the FMA kernel's output, and the GPU time of
the call (timestamp queries, ``profile_forward``), for the FMA kernel and every variant in one run.
Prints PASS / FAIL lines, then one summary line per variant; exits 1 if a check failed.

Usage::

    python scripts/experiment_sgmat_partials.py [--backend dawn] [--variants sgmat sgmat2-wg128 ...]
        [--skip-small] [--skip-prefill] [--repeat 5] [--prefill TQ L]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_sgmat_partials as chk  # noqa: E402  (its problems and checks)

import paged_sparse_attn as psa  # noqa: E402
from paged_sparse_attn.backends.wgpu import _sgmat  # noqa: E402
from paged_sparse_attn.errors import UnsupportedError  # noqa: E402
from paged_sparse_attn.testing.assertions import assert_attention_close  # noqa: E402

FMA = "psa_partials.wgsl"
# label -> (kernel the host is asked for, workgroup size of the variant or None)
VARIANTS = {
    "sgmat": (_sgmat.SGMAT, None),
    "sgmat2-wg128": (_sgmat.SGMAT2, 128),
    "sgmat2-wg64": (_sgmat.SGMAT2, 64),
    "sgmat2r16-wg128": (_sgmat.SGMAT2_R16, 128),
    "sgmat2r16-wg64": (_sgmat.SGMAT2_R16, 64),
}


def use(label: str) -> str:
    """Make the host choose the variant ``label``; returns its kernel file."""
    kernel, wg = VARIANTS[label]
    _sgmat.VARIANT = kernel
    _sgmat.VARIANT_WG = wg
    chk.SGMAT = kernel  # check_case fails a run of another kernel
    return kernel


def small_cases():
    out = chk.cases()
    # NHD caches (R34): the NaN / +-inf problem again, each page row holding every KV head
    name, d, special = next(c for c in out if c[2] == "nonfinite")
    out.append((name + ", NHD caches", dict(d, kv_layout="NHD"), special))
    return out


def prepare_small(be, cases) -> list:
    """Per problem, once for every variant: the reference, the derived R20 tolerance and the FMA
    kernel's output and NaN / inf pattern (as ``check_sgmat_partials.check_case``)."""
    fma = type(be)(partials_kernel="generic")
    out = []
    for name, d, special in cases:
        p = chk.problem(d, name)
        clean = {k: np.where(np.isfinite(d[k]), d[k], 0).astype(d[k].dtype) for k in ("q", "k_cache", "v_cache")}
        tol = chk.problem(dict(d, **clean)).tolerance()  # sigma and V over the finite data
        ref, ref_lse = p.reference()
        fo, fl = p.forward(fma)
        fo, fl = np.asarray(fo), np.asarray(fl)
        verdict(f"[fma] {name}", fo, fl, ref, ref_lse, p, tol)
        out.append((name, p, special, tol, ref, ref_lse, chk._patterns(fo, fl)))
    return out


def verdict(name: str, out, lse, ref, ref_lse, p, tol) -> bool:
    """R20 bounds against the reference and non-finite entries exactly where it has them."""
    rows = ~np.isnan(ref_lse)
    try:
        assert_attention_close(out, ref, dtype=p.dtypes, lse=np.where(rows, lse, 0), ref_lse=np.where(rows, ref_lse, 0),
                               tol=tol, rows=rows)
    except AssertionError as exc:
        chk.report(False, name, str(exc).splitlines()[0][:400])
        return False
    nf_ok = np.array_equal(~np.isfinite(out), ~np.isfinite(ref)) and np.array_equal(
        np.isnan(lse), np.isnan(ref_lse)) and np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref) & np.isfinite(out)
    err = float(np.abs(out[fin].astype(np.float64) - ref[fin]).max(initial=0.0))
    lim = tol.out_limit(float(np.abs(ref[fin]).max(initial=0.0)))
    chk.report(nf_ok, name, f"max |out - ref| {err:.3g} (limit {lim:.3g}), non-finite entries "
                            f"{int((~np.isfinite(out)).sum())}{'' if nf_ok else ' at other places than the reference'}")
    return nf_ok


def check_small(be, label: str, prepared) -> int:
    """The small problems on the variant; returns the number of failed checks."""
    n0 = len(chk.FAILED)
    want = use(label)
    sg = type(be)(partials_kernel="sgmat")
    for name, p, special, tol, ref, ref_lse, fma_pat in prepared:
        try:
            out, lse = p.forward(sg)
            out, lse = np.asarray(out), np.asarray(lse)
        except UnsupportedError as exc:
            print(f"SKIP [{label}] {name}: {str(exc)[:300]}", flush=True)  # the FMA kernel runs these
            continue
        except Exception as exc:  # noqa: BLE001  (a failing kernel is a failed check, not a crash)
            chk.report(False, f"[{label}] {name}", f"{type(exc).__name__}: {exc}")
            continue
        kern = sg.last_timings.get("kernel")
        if kern != want:
            chk.report(False, f"[{label}] {name}", f"ran {kern}, not {want}")
            continue
        if verdict(f"[{label}] {name}", out, lse, ref, ref_lse, p, tol) and special:
            same = all(np.array_equal(a, b) for a, b in zip(fma_pat, chk._patterns(out, lse)))
            chk.report(same, f"[{label} = fma NaN / inf pattern] {name}")
    chk.check_partials(sg)
    return len(chk.FAILED) - n0


def prefill_problem(tq: int = 4096, L: int = 32768):
    from paged_sparse_attn.bench.workloads import Workload, make_problem

    w = Workload("prefill-f16", B=1, L=L, Tq_per_seq=tq, dtype="float16", Hq=32, Hkv=4, D=128,
                 page_size=64, block_size=128, topk=16)
    prob = make_problem(w)
    n_sub = 64  # the last queries: the same positions and selections in a problem of their own
    sub = dict(prob, q=prob["q"][-n_sub:], selected=prob["selected"][-n_sub:],
               cu_seqlens_q=np.array([0, n_sub], np.int32))
    ps = chk.problem(dict(sub, softmax_scale=None))
    ref, ref_lse = ps.reference()
    return prob, ps, ref, ref_lse, n_sub


def run_prefill(bk, label: str, want: str, pre, repeat: int, fma_out) -> tuple[int, str, tuple | None]:
    """Correctness and GPU time of the prefill call on ``bk``; (failed checks, summary, output)."""
    from paged_sparse_attn._index import build_index_arrays
    from paged_sparse_attn._validation import validate_forward

    prob, ps, ref, ref_lse, n_sub = pre
    tol = ps.tolerance()
    n0 = len(chk.FAILED)
    summary = "prefill not run"
    res = None
    kd, vd = bk.upload_kv_cache(prob["k_cache"], prob["v_cache"])
    try:
        args = dict(prob, k_cache=kd, v_cache=vd)
        out, lse = psa.forward(**args, backend=bk, return_lse=True)
        out, lse = np.asarray(out), np.asarray(lse)
        res = (out, lse)
        err = float(np.abs(out[-n_sub:] - ref).max())
        try:
            assert_attention_close(out[-n_sub:], ref, dtype=ps.dtypes, lse=lse[-n_sub:], ref_lse=ref_lse, tol=tol)
            chk.report(True, f"[{label}] prefill: last {n_sub} queries against the reference",
                       f"max |out - ref| {err:.3g} (limit {tol.out_limit(0):.3g})")
        except AssertionError as exc:
            chk.report(False, f"[{label}] prefill: last {n_sub} queries against the reference",
                       str(exc).splitlines()[0][:400])
        dfma = float("nan")
        if fma_out is not None:
            lim = tol.times(2)
            dfma = float(np.abs(out - fma_out[0]).max())
            try:
                assert_attention_close(out, fma_out[0], dtype=ps.dtypes, lse=lse, ref_lse=fma_out[1], tol=lim)
                chk.report(True, f"[{label}] prefill: every query against the FMA kernel",
                           f"max |diff| {dfma:.3g} (limit {lim.out_limit(0):.3g})")
            except AssertionError as exc:
                chk.report(False, f"[{label}] prefill: every query against the FMA kernel",
                           str(exc).splitlines()[0][:400])
        p = validate_forward("experiment", args["q"], kd, vd, args["block_tables"], args["selected"],
                             args["cu_seqlens_q"], used_kv_lens=args["used_kv_lens"],
                             block_size=args["block_size"], softmax_scale=None, causal=args["causal"])
        idx = build_index_arrays(p.selected, p.layout)
        prof = bk.profile_forward(p, idx, repeat=repeat, kernel="auto", replay="auto", warmup_s=0.3)
        call = prof.get("call_s")
        ran = prof.get("kernel")
        chk.report(ran == want, f"[{label}] prefill ran {ran}", "" if ran == want else f"expected {want}")
        summary = (f"prefill GPU call {call * 1e3 if call else float('nan'):.3f} ms (one pass), partials "
                   f"{prof['partials_s'] * 1e3:.3f} ms, combine {prof['combine_s'] * 1e3:.3f} ms, all passes "
                   f"{prof['total_s'] * 1e3:.3f} ms ({prof.get('timer')}); last {n_sub} vs ref {err:.3g}, "
                   f"all vs FMA {dfma:.3g}")
    except Exception as exc:  # noqa: BLE001  (a failed check, not a crash)
        chk.report(False, f"[{label}] prefill", f"{type(exc).__name__}: {str(exc)[:400]}")
    finally:
        kd.release()
        vd.release()
    return len(chk.FAILED) - n0, summary, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prefill", nargs=2, type=int, default=(4096, 32768), metavar=("TQ", "L"),
                    help="queries and sequence length of the prefill workload")
    a = ap.parse_args()
    np.seterr(invalid="ignore", over="ignore")  # NaN and inf are part of the checks
    t0 = time.perf_counter()
    be = psa.get_backend(a.backend)
    ctx = be.device_context
    have = getattr(ctx, "sgmat", frozenset())
    print(f"{be!r}: subgroup matrices {sorted(have)}; workgroup memory {ctx.workgroup_storage} B", flush=True)
    if (16, 16, 16) not in have:
        chk.report(False, "the device has 16x16x16 float16 subgroup matrices")
        return 1
    default = (_sgmat.VARIANT, _sgmat.VARIANT_WG)
    lines: dict[str, list[str]] = {v: [] for v in ["fma", *a.variants]}
    fails: dict[str, int] = {v: 0 for v in lines}
    try:
        if not a.skip_small:
            t1 = time.perf_counter()
            prepared = prepare_small(be, small_cases())
            print(f"  small problems: references and the FMA kernel's outputs, {time.perf_counter() - t1:.1f} s",
                  flush=True)
            for label in a.variants:
                t1 = time.perf_counter()
                fails[label] += check_small(be, label, prepared)
                lines[label].append(f"small problems {'PASS' if not fails[label] else 'FAIL'} "
                                    f"({time.perf_counter() - t1:.1f} s)")
        if not a.skip_prefill:
            t1 = time.perf_counter()
            pre = prefill_problem(*a.prefill)
            print(f"  prefill problem and the reference of its last {pre[4]} queries: "
                  f"{time.perf_counter() - t1:.1f} s", flush=True)
            cls = type(be)
            _sgmat.VARIANT, _sgmat.VARIANT_WG = default
            n, s, fma_out = run_prefill(cls(disable_features=("chromium-experimental-subgroup-matrix",)), "fma",
                                        FMA, pre, a.repeat, None)
            fails["fma"] += n
            lines["fma"].append(s)
            for label in a.variants:
                want = use(label)
                n, s, _ = run_prefill(cls(partials_kernel="auto"), label, want, pre, a.repeat, fma_out)
                fails[label] += n
                lines[label].append(s)
    finally:
        _sgmat.VARIANT, _sgmat.VARIANT_WG = default
    print("--- summary (one line per variant)", flush=True)
    for label, parts in lines.items():
        what = FMA if label == "fma" else f"{VARIANTS[label][0]} WG={VARIANTS[label][1] or 'host'}"
        print(f"{'PASS' if not fails[label] else 'FAIL'} {label:13s} [{what}]: {'; '.join(parts)}", flush=True)
    print(f"{'FAIL' if chk.FAILED else 'PASS'}: {len(chk.FAILED)} failed check(s); {time.perf_counter() - t0:.1f} s",
          flush=True)
    return 1 if chk.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
