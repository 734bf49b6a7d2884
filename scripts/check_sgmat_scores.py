"""Check and time the tensor-core block scores (psa_block_scores_sgmat.wgsl) on a GPU.

Run on a machine with Dawn (the ``wgpudawn`` package) and a GPU with f16 subgroup matrices:

    python scripts/check_sgmat_scores.py [--backend dawn] [--repeat 10] [--quick]

It opens the backend, says which block-score kernel each problem runs, and compares
``block_scores`` and ``select_topk`` with the float64 loop reference (small problems: partial
blocks, unmapped pages, causal and not, item tiles of 16/32/64 rows, NaN and +-inf in queries and
in masked key positions, |q| > 65504, tiny and zero queries, a wide dynamic range, scales -1 and
0) and with the numpy backend (decode and the prefill shape: Tq = 4096, L = 32k, Hkv = 4,
d_idx = 128, block 128, page 64, float16 index keys), with the bound of R22 (twice it against the
numpy backend: two rounded results). Non-finite and empty scores must match exactly; the
selection of the backend's scores must equal the reference selection of the same scores (R24);
two runs must give the same bits (R19). It then times the block scores of the prefill shape with
GPU timestamps, the tensor-core kernel against the FMA kernel (psa_block_scores.wgsl, forced by
the backend's kernel choice). Each check prints one PASS or FAIL line; the exit
status is the number of FAILs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _index_branch as ib
from paged_sparse_attn.index_branch import block_scores, select_topk
from paged_sparse_attn.index_branch._validation import validate_block_scores
from paged_sparse_attn.index_branch.reference import (
    block_scores_reference,
    select_topk_reference,
)

EPS = float(np.finfo(np.float32).eps)
FAILS: list[str] = []
USED: list[str] = []  # block-score kernels of the last call


def report(ok: bool, name: str, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def spy_kernels(be) -> None:
    """Record which block-score kernel each call builds (the kernel name of every pipeline)."""
    orig = be._ib_pipeline

    def spy(kernel, f16, constants, *entry):
        if "block_scores" in kernel:
            USED.append(f"{kernel.replace('psa_block_scores', 'scores').replace('.wgsl', '')}{dict(constants)}")
        return orig(kernel, f16, constants, *entry)

    be._ib_pipeline = spy


# --- problems ----------------------------------------------------------------------------------

def problem(rng, T, L, *, Hkv=4, Hk=1, d=128, S=64, BS=128, unmapped=0.0, poison=True):
    """Index problem: sequences of T[b] queries over L[b] cached positions, float16 index keys.

    With ``poison``, every cell no query may see holds NaN or +-inf: pages no block table maps,
    positions >= L_b of the last page, and unmapped pages' data (never read)."""
    B = len(T)
    ppb = BS // S
    maxp = max(-(-max(L) // S), 1)
    maxp += (-maxp) % ppb
    P = B * maxp + 3
    perm = rng.permutation(P)
    bt = np.full((B, maxp), -1, np.int32)
    used = set()
    for b in range(B):
        for j in range(-(-L[b] // S)):
            if j and rng.random() < unmapped:
                continue  # an unmapped page (hole)
            bt[b, j] = perm[b * maxp + j]
            used.add(int(bt[b, j]))
    ik = rng.standard_normal((P, Hk, S, d), dtype=np.float32).astype(np.float16)
    if poison:
        for pgid in set(range(P)) - used:
            ik[pgid] = np.float16(np.nan) if pgid % 2 else np.float16(np.inf)
        for b in range(B):
            j, off = divmod(L[b], S)
            if off and bt[b, j] >= 0:
                ik[bt[b, j], :, off:] = np.float16(-np.inf) if b % 2 else np.float16(np.nan)
    iq = rng.standard_normal((sum(T), Hkv, d), dtype=np.float32)
    cu = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)
    return dict(index_q=iq, index_k_cache=ik, block_tables=bt, cu_seqlens_q=cu,
                used_kv_lens=np.asarray(L, np.int32), block_size=BS)


def args_of(p):
    return (p["index_q"], p["index_k_cache"], p["block_tables"], p["cu_seqlens_q"], p["used_kv_lens"])


def bound_of(p, scale, causal, factor=1.0, ref_fn=None):
    """R22's bound (the kit's): (d + 2) eps32 max_p |beta| |iq| . |ik| (+ tiny)."""
    fn = ref_fn or block_scores_reference
    kw = dict(block_size=p["block_size"], causal=causal, softmax_scale=None if scale is None else abs(scale))
    # a finite score is the logit of a position without NaN or inf operands: the others count 0
    aq, ak = (np.nan_to_num(np.abs(p[n]), nan=0.0, posinf=0.0) for n in ("index_q", "index_k_cache"))
    mag = np.asarray(fn(aq, ak, *args_of(p)[2:], **kw), np.float64)
    mag = np.abs(np.where(np.isfinite(mag), mag, 0.0))
    return factor * ((p["index_q"].shape[2] + 2) * EPS * mag + np.finfo(np.float32).tiny)


def compare(name, got, ref, bound) -> None:
    got = np.asarray(got)
    ok_shape = got.shape == ref.shape and got.dtype == np.float32
    neg = np.array_equal(np.isneginf(got), np.isneginf(ref))
    pos = np.array_equal(np.isposinf(got), np.isposinf(ref))
    nan = np.array_equal(np.isnan(got), np.isnan(ref))
    fin = np.isfinite(ref)
    err = np.abs(got[fin].astype(np.float64) - ref[fin])
    ratio = float((err / bound[fin]).max()) if err.size else 0.0
    detail = (f"{USED[-1] if USED else '?'}; max err {err.max() if err.size else 0:.3g}, max err/bound "
              f"{ratio:.3g}; -inf {'ok' if neg else 'DIFFER'}, +inf {'ok' if pos else 'DIFFER'}, "
              f"NaN {'ok' if nan else 'DIFFER'} ({int(np.isnan(ref).sum())} NaN, {int(np.isinf(ref).sum())} inf "
              f"in the reference)")
    report(ok_shape and neg and pos and nan and ratio <= 1.0, name, detail)


def check_small(be, name, p, *, scale=None, causal=True, want_kernel=None) -> None:
    USED.clear()
    kw = dict(block_size=p["block_size"], causal=causal, softmax_scale=scale)
    got = np.asarray(block_scores(*args_of(p), **kw, backend=be))
    ref = block_scores_reference(*args_of(p), **kw)
    compare(f"scores {name}", got, ref, bound_of(p, scale, causal))
    if want_kernel is not None:
        report(bool(USED) and want_kernel in USED[-1], f"kernel {name}", f"wanted {want_kernel}, ran {USED}")
    topk = 3
    tk = dict(force_local=True, cu_seqlens_q=p["cu_seqlens_q"], used_kv_lens=p["used_kv_lens"],
              block_size=p["block_size"])
    sel = np.asarray(select_topk(got, topk, **tk, backend=be))
    report(np.array_equal(sel, select_topk_reference(got, topk, **tk)), f"topk {name}", "exact (R24)")


def small_suite(be, rng, sgmat: str) -> None:
    # tiles of 64, 32 and 16 rows; partial blocks (L not a multiple of 128), holes; causal and not
    p = problem(rng, [70, 33], [700, 301], Hkv=2, unmapped=0.2)
    check_small(be, "T=[70,33] L=[700,301] Hkv=2 causal", p, want_kernel=sgmat)
    check_small(be, "same, causal=False", p, causal=False, want_kernel=sgmat)
    check_small(be, "same, scale=-1", p, scale=-1.0)
    check_small(be, "same, scale=0", p, scale=0.0)
    p = problem(rng, [5, 7, 6], [260, 129, 1000], Hkv=4)
    check_small(be, "rows/seq 28 (RT=32)", p, want_kernel=sgmat)
    p = problem(rng, [3, 2], [513, 64], Hkv=4)
    check_small(be, "rows/seq 12 (RT=16)", p, want_kernel=sgmat)
    p = problem(rng, [40, 9], [1500, 200], Hkv=3, Hk=3, unmapped=0.3)
    check_small(be, "Hk_idx=Hkv=3", p, want_kernel=sgmat)
    for d in (16, 64):
        p = problem(rng, [20, 30], [400, 700], Hkv=2, d=d)
        check_small(be, f"d_idx={d}", p, want_kernel=sgmat)
    p = problem(rng, [20, 30], [400, 700], Hkv=2, d=40)
    check_small(be, "d_idx=40 (not whole 16-dim chunks: FMA kernel)", p, want_kernel="scores{")
    p = problem(rng, [24], [300], Hkv=2, d=8)
    check_small(be, "d_idx=8 (FMA kernel)", p, want_kernel="scores{")
    p = problem(rng, [50, 20], [900, 333], Hkv=2, S=16, BS=64, unmapped=0.2)
    check_small(be, "page 16, block 64", p, want_kernel=sgmat)
    p = problem(rng, [20, 12], [300, 1100], Hkv=2, S=64, BS=256)
    check_small(be, "block 256 (two passes per item)", p, want_kernel=sgmat)

    # special values in the queries (their items take the FMA path) and the row scaling
    p = problem(rng, [40, 30], [600, 500], Hkv=2)
    iq = p["index_q"]
    iq[3, 0, 5] = np.nan
    iq[10, 1, 7] = np.inf
    iq[11, 0, 9] = -np.inf
    iq[45, 0] = 0.0  # a zero row
    iq[20:25] *= np.float32(1e6)  # |q| > 65504: scaled into float16's range
    iq[50:55] *= np.float32(1e-6)
    iq[56, 1] *= np.float32(1e-30)  # tiny rows, scaled by 2^100 and more
    iq[57, 1, 3] = np.float32(1e-7)  # a wide dynamic range in one row (the matrix path all the same)
    iq[58, 0, 4] = np.float32(3e-5)
    iq[59, 1, 2] = np.float32(1e-41)  # a subnormal element
    check_small(be, "NaN/inf/huge/tiny/zero queries", p, want_kernel=sgmat)
    check_small(be, "same, causal=False", p, causal=False)
    check_small(be, "same, scale=0 (0 * inf = NaN)", p, scale=0.0)

    # non-finite keys at positions some rows of an item see and others do not (causal future)
    p = problem(rng, [40, 30], [600, 500], Hkv=2)
    ik, bt, S = p["index_k_cache"], p["block_tables"], 64
    for b, (pos, val) in enumerate([(590, np.inf), (480, np.nan)]):
        ik[bt[b, pos // S], 0, pos % S, 11] = val
    ik[bt[0, 3], 0, 5, 0] = -np.inf  # a visible -inf key (position 197)
    check_small(be, "inf/NaN keys in the causal future of some rows", p, want_kernel=sgmat)
    check_small(be, "same, causal=False", p, causal=False)

    # many queries of one sequence across several 64-row items, all blocks partly in the future
    p = problem(rng, [300], [1000], Hkv=4)
    check_small(be, "T=300 L=1000 causal (prefill-like)", p, want_kernel=sgmat)


def big_check(be, name, p, *, want_kernel, repeat_bits=True):
    """Against the numpy backend (float32 matmul): twice the bound."""
    USED.clear()
    kw = dict(block_size=p["block_size"], causal=True)
    t = time.perf_counter()
    got = np.asarray(block_scores(*args_of(p), **kw, backend=be))
    t_be = time.perf_counter() - t
    ref = np.asarray(block_scores(*args_of(p), **kw, backend="numpy"))
    npb = registry.get_backend("numpy")
    bound = bound_of(p, None, True, factor=2.0,
                     ref_fn=lambda *a, **k: block_scores(*a, **k, backend=npb))
    compare(f"scores {name} (vs numpy, {t_be:.2f} s)", got, ref, bound)
    report(bool(USED) and want_kernel in USED[-1], f"kernel {name}", f"wanted {want_kernel}, ran {USED[-1:]}")
    if repeat_bits:
        again = np.asarray(block_scores(*args_of(p), **kw, backend=be))
        report(got.tobytes() == again.tobytes(), f"deterministic {name}", "two runs, same bits (R19)")
    tk = dict(force_local=True, cu_seqlens_q=p["cu_seqlens_q"], used_kv_lens=p["used_kv_lens"],
              block_size=p["block_size"])
    sel = np.asarray(select_topk(got, 16, **tk, backend=be))
    report(np.array_equal(sel, select_topk_reference(got, 16, **tk)), f"topk {name}", "exact (R24)")
    return got


# --- timing --------------------------------------------------------------------------------------

def gpu_time(be, p, repeat: int) -> tuple[float, str]:
    """Median GPU time (s) of the block-score dispatches of ``p`` (index keys device-resident),
    from timestamps around one compute pass; and the kernel that ran."""
    USED.clear()
    ik = be.upload_index_cache(p["index_k_cache"])
    try:
        prob = validate_block_scores("block_scores", p["index_q"], ik, *args_of(p)[2:],
                                     block_size=p["block_size"], softmax_scale=None, causal=True)
        with be._lock:
            st = be._score_setup(prob, "block_scores")
            ctx = be._device()
            Tq, Hkv, d = prob.index_q.shape
            assert st.nch == 1 and st.step >= Tq, "one chunk and one query batch expected"
            U = _usage()
            dev = ctx.device
            iq = np.zeros((Tq, Hkv, st.DV * 4), np.float32)
            iq[:, :, :d] = prob.index_q
            items = st.plan(0, Tq)[0]
            words = np.concatenate([st.qend.astype(np.int32).view(np.uint32), items.astype(np.uint32).reshape(-1)])
            mk = lambda a: dev.create_buffer_with_data(data=np.ascontiguousarray(a), usage=U.STORAGE)
            qbuf, pbuf, plbuf = mk(iq), mk(st.pt), mk(words)
            nbytes = Tq * Hkv * prob.msb * 4
            obuf = dev.create_buffer(size=nbytes, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)
            align = ctx.uniform_align
            recs, grids = [], []
            for f2, cnt, gx, gy in ib.score_dispatches(items.shape[0], st.ipw, ctx.workgroups_per_dim):
                recs.append(ib._record(f2, cnt, gx, Tq, Hkv, prob.msb, float(prob.softmax_scale), int(st.starts[0]),
                                       int(st.starts[1])))
                grids.append((gx, gy))
            params = np.zeros((len(recs), align // 4), np.uint32)
            for i, r in enumerate(recs):
                params[i, :r.shape[0]] = r
            ubuf = dev.create_buffer_with_data(data=params, usage=U.UNIFORM)
            groups = [dev.create_bind_group(layout=st.bgl, entries=[
                {"binding": 0, "resource": {"buffer": ubuf, "offset": i * align, "size": ib.PARAM_BYTES}}] + [
                {"binding": j + 1, "resource": {"buffer": b}}
                for j, b in enumerate([qbuf, ik.buffers()[0], pbuf, plbuf, obuf])]) for i in range(len(recs))]
            qs = dev.create_query_set(type="timestamp", count=2)
            qb = dev.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)
            times = []
            for _ in range(repeat + 2):
                enc = dev.create_command_encoder()
                enc.clear_buffer(obuf, 0, nbytes)
                cp = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                              "end_of_pass_write_index": 1})
                cp.set_pipeline(st.pipe)
                for g, (gx, gy) in zip(groups, grids):
                    cp.set_bind_group(0, g)
                    cp.dispatch_workgroups(gx, gy, 1)
                cp.end()
                enc.resolve_query_set(qs, 0, 2, qb, 0)
                dev.queue.submit([enc.finish()])
                ts = np.frombuffer(dev.queue.read_buffer(qb), np.uint64)
                times.append((int(ts[1]) - int(ts[0])) * float(getattr(ctx, "ns_per_tick", 1.0)) * 1e-9)
            for b in (qbuf, pbuf, plbuf, obuf, ubuf, qb):
                b.destroy()
        return statistics.median(times[2:]), (USED[-1] if USED else "?")
    finally:
        ik.release()


def _usage():
    try:
        import wgpudawn as w
    except ImportError:
        import wgpu as w
    return w.BufferUsage


class forced_fma:
    """Within the block, the backend never picks the tensor-core kernel (the FMA kernel runs)."""

    def __init__(self, be):
        self.be = be

    def __enter__(self):
        self.orig = self.be._scores_kernel
        self.be._scores_kernel = "fma"

    def __exit__(self, *exc):
        self.be._scores_kernel = self.orig


# --- main ----------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="skip the prefill-shape comparison (timing only)")
    ap.add_argument("--small-only", action="store_true", help="only the small problems (no decode, prefill, timing)")
    ap.add_argument("--no-robustness", action="store_true",
                    help="open Dawn without its bounds checks (DawnBackend(robustness=False))")
    a = ap.parse_args()
    t_start = time.perf_counter()
    try:
        if a.no_robustness:
            from paged_sparse_attn.backends.wgpu.backend import DawnBackend

            be = DawnBackend(robustness=False)
        else:
            be = registry.get_backend(a.backend)
        ctx = be._device()
    except Exception as exc:  # noqa: BLE001 -- report, then stop: nothing else can run
        report(False, "open backend", f"{a.backend}: {type(exc).__name__}: {exc}")
        return 1
    spy_kernels(be)
    geo, why = ib.sgmat_scores_constants(ctx, f16=True, d_idx=128, rows_per_seq=64, hnd=True,
                                         batch_invariant=False)
    print(f"device: {getattr(ctx, 'summary', '?')}; runtime {getattr(ctx, 'runtime', '?')}; sgmat "
          f"{sorted(getattr(ctx, 'sgmat', ()))}; subgroup {getattr(ctx, 'subgroup', '?')}; workgroup memory "
          f"{ctx.workgroup_storage} B; prefill geometry {geo or why}", flush=True)
    report(geo is not None, "tensor-core kernel available", str(geo or why))
    sgmat = "scores_sgmat" if geo is not None else "scores{"
    rng = np.random.default_rng(1234)
    small_suite(be, rng, sgmat)
    print(f"(small problems done at {time.perf_counter() - t_start:.1f} s)", flush=True)
    if a.small_only:
        print(f"{len(FAILS)} FAIL(s){': ' + ', '.join(FAILS) if FAILS else ''}")
        return len(FAILS)

    # decode: one query per sequence (the decode kernel), against numpy
    dec = problem(rng, [1] * 16, [int(x) for x in rng.integers(2000, 8000, 16)], Hkv=4, poison=False)
    big_check(be, "decode B=16 Hkv=4", dec, want_kernel="scores_decode")
    L, Tq = 32768, 4096
    pre = problem(np.random.default_rng(0), [Tq], [L], Hkv=4, poison=False)
    if not a.quick:
        got = big_check(be, "prefill Tq=4096 L=32k", pre, want_kernel=sgmat)
        with forced_fma(be):
            USED.clear()
            fma = np.asarray(block_scores(*args_of(pre), block_size=128, causal=True, backend=be))
        fin = np.isfinite(fma)
        print(f"     tensor-core vs FMA kernel on the prefill shape: max |diff| "
              f"{np.abs(got[fin] - fma[fin]).max():.3g}, identical -inf pattern "
              f"{np.array_equal(np.isneginf(got), np.isneginf(fma))}", flush=True)
    print(f"(checks done at {time.perf_counter() - t_start:.1f} s)", flush=True)
    t_sg, k_sg = gpu_time(be, pre, a.repeat)
    with forced_fma(be):
        t_fma, k_fma = gpu_time(be, pre, a.repeat)
    print(f"TIME block scores prefill (Tq=4096, L=32k, Hkv=4, d_idx=128, f16 keys), GPU timestamps, median of "
          f"{a.repeat}: {k_sg}: {t_sg * 1e3:.3f} ms; {k_fma}: {t_fma * 1e3:.3f} ms; speed-up {t_fma / t_sg:.2f}x",
          flush=True)
    report(t_sg < 1.7e-3, "prefill block scores under 1.7 ms", f"{t_sg * 1e3:.3f} ms")
    print(f"{len(FAILS)} FAIL(s){': ' + ', '.join(FAILS) if FAILS else ''}; {time.perf_counter() - t_start:.1f} s")
    return len(FAILS)


if __name__ == "__main__":
    sys.exit(main())
