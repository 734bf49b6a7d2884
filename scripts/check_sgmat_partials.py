"""Check and time the subgroup-matrix partials kernel (``psa_partials_sgmat.wgsl``) on a GPU.

Needs the ``dawn`` backend (the wgpu host code on Dawn) and a GPU with 16x16x16 float16 subgroup
matrices (e.g. an NVIDIA H200). Prints one PASS or FAIL line per check, then timings; exits 1 if
a check failed. About 30 to 60 s on an H200.

1. Small adversarial problems (float16 caches), each through ``forward()`` with the sgmat kernel
   forced (``partials_kernel="sgmat"``) and with the FMA kernel (``"generic"``), against the
   float64 reference within the problem's derived R20 tolerance (a problem the sgmat kernel does
   not take, D = 256, prints SKIP for it) (the kit's
   ``AttentionProblem.tolerance()`` and ``assert_attention_close``): causal prefill with partial
   blocks, G = 1 / 4 / 8, D = 64 / 128 / 256, empty rows and unmapped pages, NaN and +-inf in
   cache positions a row does not attend (sharing tiles with rows that attend them), |q| > 65504
   and |q| < 2^-24 (with scales that make the scores O(1)), a non-finite q, scores that
   overflow to -inf (removed, with NaN values). Non-finite
   components must sit exactly where the reference has them, and the sgmat kernel's pattern of
   NaN / +-inf must equal the FMA kernel's. One problem also compares ``forward_partials`` with
   the kit's per-edge oracle.
2. The prefill workload (B=1, L=32k, last 4096 queries, causal, Hq=32, Hkv=4, D=128, top-16 of
   128-position blocks, page 64, float16 caches, resident on the device), through ``forward()``
   with ``partials_kernel="auto"`` (the plan path, as in production) on the backend as is (the
   sgmat kernel) and with ``disable_features=("chromium-experimental-subgroup-matrix",)`` (the
   FMA kernel): the last 64 queries against the reference of that sub-problem, the whole output
   against the FMA kernel's (within twice the sub-problem's tolerance: two rounded results),
   then the GPU time of the call (timestamp queries, ``profile_forward``: the call's kernels in
   one pass, and the partials passes alone) and the host time of ``forward()`` end to end, with
   host arrays and with device-resident ``q``, ``selected`` and outputs.

Usage::

    python scripts/check_sgmat_partials.py [--backend dawn] [--skip-prefill]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import paged_sparse_attn as psa
from paged_sparse_attn.errors import UnsupportedError
from paged_sparse_attn.testing import oracle
from paged_sparse_attn.testing.assertions import (
    assert_attention_close,
    assert_partials_close,
)
from paged_sparse_attn.testing.problem import AttentionProblem

SGMAT = "psa_partials_sgmat.wgsl"
FAILED: list[str] = []


def report(ok: bool, name: str, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


# --- problems ----------------------------------------------------------------------------------

def make(seed: int, *, lens, tq, Hq, Hkv, D, S, BS, topk, causal=True, holes=0, empty_rows=0,
         scale=None) -> dict:
    """Random paged problem: sequences of ``lens`` positions, the last ``tq[b]`` of each are
    queries (causal) or ``tq[b]`` queries seeing everything; local block + random blocks; float16
    caches; ``holes`` unmapped pages; ``empty_rows`` queries that select nothing."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    ppb = BS // S
    msb = max(-(-L // BS) for L in lens)
    max_pages = msb * ppb
    P = B * max_pages + 3
    bt = rng.permutation(P)[:B * max_pages].astype(np.int32).reshape(B, max_pages)
    for b, L in enumerate(lens):  # pages past the sequence: unmapped
        bt[b, -(-L // S):] = -1
    if holes:
        mapped = np.argwhere(bt >= 0)
        for i in rng.choice(len(mapped), size=holes, replace=False):
            bt[tuple(mapped[i])] = -1
    cu = np.concatenate([[0], np.cumsum(tq)]).astype(np.int32)
    Tq = int(cu[-1])
    sel = np.full((Tq, Hkv, topk), -1, np.int32)
    for b, L in enumerate(lens):
        for i in range(tq[b]):
            t = cu[b] + i
            hi = (L - tq[b] + i) if causal else L - 1
            local = hi // BS
            for h in range(Hkv):
                others = rng.permutation(local)[:topk - 1] if local else np.zeros(0, int)
                ch = np.concatenate([[local], others])
                sel[t, h, :ch.shape[0]] = rng.permutation(ch)
    if empty_rows:
        sel[rng.choice(Tq, size=empty_rows, replace=False)] = -1
    q = rng.standard_normal((Tq, Hq, D), dtype=np.float32)
    k = rng.standard_normal((P, Hkv, S, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((P, Hkv, S, D), dtype=np.float32).astype(np.float16)
    return {"q": q, "k_cache": k, "v_cache": v, "block_tables": bt, "selected": sel, "cu_seqlens_q": cu,
            "used_kv_lens": np.asarray(lens, np.int32), "block_size": BS, "softmax_scale": scale, "causal": causal}


def problem(d: dict, values: str = "") -> AttentionProblem:
    return AttentionProblem(values=values, **d)


def cases() -> list[tuple[str, dict, str]]:
    """(name, problem arguments, what is special)."""
    out = []
    G8 = {"Hq": 16, "Hkv": 2, "D": 128, "S": 64, "BS": 128, "topk": 3}
    out.append(("causal prefill G=8 D=128, partial blocks", make(1, lens=[300, 517], tq=[40, 64], **G8), ""))
    out.append(("causal prefill G=1 D=64 (16-position pages, 64-position blocks)",
                make(2, lens=[200, 333], tq=[17, 50], Hq=4, Hkv=4, D=64, S=16, BS=64, topk=4), ""))
    out.append(("causal prefill G=4 D=256", make(3, lens=[260], tq=[70], Hq=8, Hkv=2, D=256, S=32, BS=64,
                                                  topk=3), ""))
    out.append(("non-causal G=8 D=128, unmapped pages and empty rows",
                make(4, lens=[384, 129], tq=[20, 9], causal=False, holes=3, empty_rows=4, **G8), ""))
    out.append(("G=8 D=16, blocks of 32 (16-key tiles)", make(5, lens=[100], tq=[30], Hq=8, Hkv=1, D=16, S=16,
                                                              BS=32, topk=3), ""))
    # NaN / +-inf where no row attends, and where only some rows of an item attend
    d = make(6, lens=[300, 517], tq=[40, 64], **G8)
    k, v, bt = d["k_cache"], d["v_cache"], d["block_tables"]
    S = 64
    for b, L in enumerate((300, 517)):
        last = bt[b, (L - 1) // S]
        k[last, :, L % S:] = np.nan          # past used_kv_lens, inside a read page
        v[last, :, L % S:] = np.inf
        p2 = (L - 2) // S                     # attended by the last query only (causal)
        v[bt[b, p2], :, (L - 2) % S, ::3] = np.nan
        v[bt[b, p2], :, (L - 2) % S, 1::3] = np.inf
        v[bt[b, p2], 1, (L - 2) % S, 2::3] = -np.inf
        p3 = (L - 3) // S                     # the last two queries: NaN score
        k[bt[b, p3], 0, (L - 3) % S, 5] = np.nan
    unused = np.setdiff1d(np.arange(k.shape[0]), bt[bt >= 0])
    k[unused] = np.nan
    v[unused] = -np.inf
    out.append(("NaN / +-inf in cache positions some rows of an item do not attend", d, "nonfinite"))
    # |q| beyond float16 and below its subnormals, scores O(1) through the scale: the query
    # scaling must keep q exact to ~22 bits (tight tolerance); then a non-finite q (FMA scores)
    d = make(7, lens=[300, 517], tq=[40, 64], scale=1e-5, **G8)
    d["q"] *= 1e5
    out.append(("|q| ~ 1e5 (beyond float16), softmax_scale 1e-5", d, ""))
    d = make(7, lens=[300, 517], tq=[40, 64], scale=1e30, **G8)
    d["q"] *= 1e-30
    out.append(("|q| ~ 1e-30 (below float16), softmax_scale 1e30", d, ""))
    d = make(7, lens=[300, 517], tq=[40, 64], **G8)
    d["q"][30, 3, 7] = np.inf
    d["q"][31, 9, 0] = np.nan
    d["q"][60, 0, :] = 0.0
    out.append(("a non-finite q (its rows NaN, the rest of its items exact) and a zero q", d, "nonfinite"))
    # scores that overflow float32: -inf removes its position (NaN values there), +inf a row
    rng = np.random.default_rng(8)
    d = make(8, lens=[256], tq=[32], Hq=8, Hkv=1, D=32, S=32, BS=64, topk=3, scale=1e38)
    d["q"][:] = 0.0
    d["q"][:, :, 0] = 1.0
    kk = d["k_cache"]
    kk[...] = 0.0
    kk[..., 0] = rng.choice(np.array([-4.0, 1.0, 0.5], np.float16), size=kk.shape[:3])
    d["v_cache"][kk[..., 0] == -4.0] = np.nan
    out.append(("scores overflowing to -inf remove their NaN values (scale 1e38)", d, "nonfinite"))
    return out


# --- checks ------------------------------------------------------------------------------------

def _patterns(out, lse):
    return np.isnan(out), np.isinf(out), np.isnan(lse), np.isneginf(lse)


def check_case(name: str, d: dict, special: str, sg, fma) -> None:
    p = problem(d, name)
    clean = {k: np.where(np.isfinite(d[k]), d[k], 0).astype(d[k].dtype) for k in ("q", "k_cache", "v_cache")}
    tol = problem(dict(d, **clean)).tolerance()  # sigma and V over the finite data
    ref, ref_lse = p.reference()
    sg_pat = None
    for be, label in ((sg, "sgmat"), (fma, "fma")):
        try:
            out, lse = p.forward(be)
            out, lse = np.asarray(out), np.asarray(lse)
        except UnsupportedError as exc:
            if label != "sgmat":
                raise
            print(f"SKIP [{label}] {name}: {str(exc)[:300]}", flush=True)  # the FMA kernel runs these
            continue
        except Exception as exc:  # noqa: BLE001  (a failing kernel is a failed check, not a crash)
            report(False, f"[{label}] {name}", f"{type(exc).__name__}: {exc}")
            continue
        kern = getattr(be, "last_timings", {}).get("kernel")
        if label == "sgmat" and kern != SGMAT:
            report(False, f"[{label}] {name}", f"ran {kern}, not {SGMAT}")
            continue
        rows = ~np.isnan(ref_lse)
        try:
            assert_attention_close(out, ref, dtype=p.dtypes, lse=np.where(rows, lse, 0), ref_lse=np.where(rows, ref_lse, 0),
                                   tol=tol, rows=rows)
            nf_ok = np.array_equal(~np.isfinite(out), ~np.isfinite(ref)) and np.array_equal(
                np.isnan(lse), np.isnan(ref_lse)) and np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
            fin = np.isfinite(ref) & np.isfinite(out)
            err = float(np.abs(out[fin].astype(np.float64) - ref[fin]).max(initial=0.0))
            lim = tol.out_limit(float(np.abs(ref[fin]).max(initial=0.0)))
            detail = (f"max |out - ref| {err:.3g} (limit {lim:.3g}), non-finite entries {int((~np.isfinite(out)).sum())}"
                      f"{'' if nf_ok else ' at other places than the reference'}")
            report(nf_ok, f"[{label}] {name}", detail)
            if label == "sgmat":
                sg_pat = _patterns(out, lse)
            elif special and sg_pat is not None:
                same = all(np.array_equal(a, b) for a, b in zip(sg_pat, _patterns(out, lse)))
                report(same, f"[sgmat = fma NaN / inf pattern] {name}")
        except AssertionError as exc:
            report(False, f"[{label}] {name}", str(exc).splitlines()[0][:400])


def check_partials(sg) -> None:
    d = make(11, lens=[300, 517], tq=[40, 64], Hq=16, Hkv=2, D=128, S=64, BS=128, topk=3)
    p = problem(d)
    index = p.build_index()
    try:
        part = psa.forward_partials(p.q, p.k_cache, p.v_cache, index, backend=sg)
        ro, rm, rl = oracle.edge_partials(p, index)
        assert_partials_close(np.asarray(part.o), np.asarray(part.m), np.asarray(part.l), ro, rm, rl,
                              dtype=p.dtypes, tol=p.tolerance())
        report(True, "[sgmat] forward_partials against the per-edge oracle (R14)",
               f"{index.num_edges} edges, max |o - ref| {float(np.abs(np.asarray(part.o) - ro).max()):.3g}")
    except Exception as exc:  # noqa: BLE001  (a failed check, not a crash)
        report(False, "[sgmat] forward_partials against the per-edge oracle (R14)", str(exc).splitlines()[0][:400])


def check_prefill(sg, fma) -> None:
    """``sg`` and ``fma``: instances with ``partials_kernel="auto"`` (resident caches then take
    the plan path, as in production), with and without the subgroup-matrix feature."""
    from paged_sparse_attn._index import build_index_arrays
    from paged_sparse_attn._validation import validate_forward
    from paged_sparse_attn.bench.workloads import Workload, make_problem

    w = Workload("prefill-f16", B=1, L=32768, Tq_per_seq=4096, dtype="float16", Hq=32, Hkv=4, D=128,
                 page_size=64, block_size=128, topk=16)
    t0 = time.perf_counter()
    prob = make_problem(w)
    n_sub = 64  # the last queries: the same positions and selections in a problem of their own
    sub = dict(prob, q=prob["q"][-n_sub:], selected=prob["selected"][-n_sub:],
               cu_seqlens_q=np.array([0, n_sub], np.int32))
    ps = problem(dict(sub, softmax_scale=None))
    ref, ref_lse = ps.reference()
    tol = ps.tolerance()
    print(f"  prefill problem and the reference of its last {n_sub} queries: {time.perf_counter() - t0:.1f} s",
          flush=True)
    res = {}
    for bk, label, want in ((sg, "sgmat", SGMAT), (fma, "fma", "psa_partials.wgsl")):
        kd, vd = bk.upload_kv_cache(prob["k_cache"], prob["v_cache"])
        args = dict(prob, k_cache=kd, v_cache=vd)
        try:
            out, lse = psa.forward(**args, backend=bk, return_lse=True)  # (compiles)
            out, lse = np.asarray(out), np.asarray(lse)
            walls = []
            for _ in range(3):
                t1 = time.perf_counter()
                psa.forward(**args, backend=bk, return_lse=True)
                walls.append(time.perf_counter() - t1)
            dargs = dict(args, q=bk.asarray(prob["q"]), selected=bk.asarray(prob["selected"]))
            dwalls = []
            for i in range(4):
                t1 = time.perf_counter()
                _, dl = psa.forward(**dargs, backend=bk, return_lse=True)
                np.asarray(dl.numpy())
                if i:
                    dwalls.append(time.perf_counter() - t1)
            res[label] = (out, lse)
            try:
                assert_attention_close(out[-n_sub:], ref, dtype=ps.dtypes, lse=lse[-n_sub:], ref_lse=ref_lse, tol=tol)
                err = float(np.abs(out[-n_sub:] - ref).max())
                report(True, f"[{label}] prefill: last {n_sub} queries against the reference",
                       f"max |out - ref| {err:.3g} (limit {tol.out_limit(0):.3g})")
            except AssertionError as exc:
                report(False, f"[{label}] prefill: last {n_sub} queries against the reference",
                       str(exc).splitlines()[0][:400])
            p = validate_forward("check", args["q"], kd, vd, args["block_tables"], args["selected"],
                                 args["cu_seqlens_q"], used_kv_lens=args["used_kv_lens"],
                                 block_size=args["block_size"], softmax_scale=None, causal=args["causal"])
            idx = build_index_arrays(p.selected, p.layout)
            prof = bk.profile_forward(p, idx, repeat=5, kernel="auto", replay="auto", warmup_s=0.5)
            call = prof.get("call_s")
            report(prof.get("kernel") == want, f"[{label}] prefill timing ({prof.get('kernel')})",
                   f"GPU call {call * 1e3 if call else float('nan'):.3f} ms (one pass), partials "
                   f"{prof['partials_s'] * 1e3:.3f} ms, combine {prof['combine_s'] * 1e3:.3f} ms, all passes "
                   f"{prof['total_s'] * 1e3:.3f} ms, replay {prof.get('replay')} ({prof.get('timer')}); "
                   f"forward() end to end {min(walls) * 1e3:.1f} ms with host q and out (64 MiB each way), "
                   f"{min(dwalls) * 1e3:.1f} ms with device q, selected and out")
        except Exception as exc:  # noqa: BLE001  (a failed check, not a crash)
            report(False, f"[{label}] prefill", f"{type(exc).__name__}: {str(exc)[:400]}")
        finally:
            kd.release()
            vd.release()
    if len(res) == 2:
        (a, al), (b, bl) = res["sgmat"], res["fma"]
        lim = tol.times(2)
        try:
            assert_attention_close(a, b, dtype=ps.dtypes, lse=al, ref_lse=bl, tol=lim)
            report(True, "prefill: sgmat against fma, every query",
                   f"max |diff| {float(np.abs(a - b).max()):.3g} (limit {lim.out_limit(0):.3g})")
        except AssertionError as exc:
            report(False, "prefill: sgmat against fma, every query", str(exc).splitlines()[0][:400])


def _make(be, kernel: str):
    """Another instance of ``be``'s class: the partials kernel forced (``"sgmat"``, ``"generic"``),
    or automatic with (``"auto"``) or without (``"auto-fma"``) the subgroup-matrix feature."""
    cls = type(be)
    if kernel == "auto-fma":
        return cls(disable_features=("chromium-experimental-subgroup-matrix",))
    return cls(partials_kernel=kernel)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--skip-prefill", action="store_true")
    a = ap.parse_args()
    np.seterr(invalid="ignore", over="ignore")  # NaN and inf are part of the checks
    t0 = time.perf_counter()
    be = psa.get_backend(a.backend)
    ctx = be.device_context
    have = getattr(ctx, "sgmat", frozenset())
    print(f"{be!r}: subgroup matrices {sorted(have)}; workgroup memory {ctx.workgroup_storage} B", flush=True)
    if (16, 16, 16) not in have:
        report(False, "the device has 16x16x16 float16 subgroup matrices")
        return 1
    sg, fma = _make(be, "sgmat"), _make(be, "generic")
    for name, d, special in cases():
        check_case(name, d, special, sg, fma)
    check_partials(sg)
    if not a.skip_prefill:
        check_prefill(_make(be, "auto"), _make(be, "auto-fma"))
    print(f"{'FAIL' if FAILED else 'PASS'}: {len(FAILED)} failed check(s); {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
