"""wgpu backend: profiling methods of the GPU bench suite, pooled call buffers, geometry per call."""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn._index import build_index_arrays
from paged_sparse_attn._validation import validate_forward

from paged_sparse_attn.testing.generate import random_problem


def _fwd(pr, backend, **kw):
    return psa.forward(*pr.args, **pr.options, backend=backend, **kw)


def _problem_and_index(pr, k, v):
    p = validate_forward("t", pr.q, k, v, pr.block_tables, pr.selected, pr.cu_seqlens_q, **pr.options)
    idx = build_index_arrays(p.selected, p.layout)
    return p, idx


def test_profile_forward_times_every_pass_and_matches_forward(WgpuBackend):
    be = WgpuBackend(required_limits="default")
    args = random_problem(3, seqlens_q=(3, 2), G=2, D=16, page_size=2, ppb=2, msb=4, causal=True)
    kd, vd = be.upload_kv_cache(args.k_cache, args.v_cache)
    p, idx = _problem_and_index(args, kd, vd)
    ref = be.forward(p, idx)[0]
    prof = be.profile_forward(p, idx, repeat=3)
    assert prof["repeat"] == 3
    if "timestamp-query" in be.capabilities.features:
        assert prof["timer"] == "timestamp-query"
        assert prof["partials_s"] > 0 and prof["combine_s"] > 0
        for total, part, comb in prof["samples"]:  # each call's span holds both kinds of pass
            assert total >= part + comb - 1e-9
    else:
        assert prof["timer"] == "wall" and prof["total_s"] > 0
    # profiling does not change results, and ordinary calls afterwards record no GPU times
    out = be.forward(p, idx)[0]
    assert np.array_equal(out, ref)
    assert "gpu_total_s" not in be.last_timings


def test_profile_forward_replay_times_each_replay_and_keeps_results(WgpuBackend):
    """replay=R encodes the passes R times in one submission: R span times, same outputs."""
    be = WgpuBackend(required_limits="default")
    args = random_problem(4, seqlens_q=(3, 2), G=2, D=16, page_size=2, ppb=2, msb=4, causal=True)
    kd, vd = be.upload_kv_cache(args.k_cache, args.v_cache)
    p, idx = _problem_and_index(args, kd, vd)
    ref = be.forward(p, idx)[0]
    prof = be.profile_forward(p, idx, repeat=2, replay=3, warmup_s=0.01)
    assert prof["replay"] == 3 and prof["repeat"] == 2
    if "timestamp-query" in be.capabilities.features:
        per = be.last_timings["gpu_replays"]
        assert len(per) == 3
        for part, comb, total in per:
            assert part > 0 and comb > 0 and total >= part + comb - 1e-9
        totals = [t for t, _, _ in prof["samples"]]
        assert min(totals) <= prof["total_s"] <= max(totals)  # a typical sample, not a sum or a mean of parts
        # the same calls in one pass (as forward() encodes them), timed around it, per replay
        assert prof["call_s"] > 0
    auto = be.profile_forward(p, idx, repeat=1, replay="auto")
    assert auto["replay"] >= 10  # at least 10 replays, more when one replay is short
    out = be.forward(p, idx)[0]
    assert np.array_equal(out, ref)
    assert "gpu_replays" not in be.last_timings  # ordinary calls replay nothing


def test_runtime_checks_do_not_change_results(WgpuBackend):
    """The attention kernels give the same bits with and without naga's runtime checks: every
    index they use is in range (a clamped out-of-range access would change them)."""
    on = WgpuBackend(required_limits="default", runtime_checks=True)
    off = WgpuBackend(required_limits="default")
    for seed, kw in ((7, dict(seqlens_q=(3, 2), G=2, D=16)), (8, dict(seqlens_q=(1, 1, 1), G=8, D=64))):
        args = random_problem(seed, page_size=2, ppb=2, msb=4, causal=True, **kw)
        a = _fwd(args, on, return_lse=True)
        b = _fwd(args, off, return_lse=True)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("what", ["copy", "read"])
def test_bandwidth_ceilings_are_positive_and_report_their_timer(WgpuBackend, what):
    be = WgpuBackend(required_limits="default")
    bw = getattr(be, f"{what}_bandwidth")(1 << 20, repeat=2)
    assert np.isfinite(bw) and bw > 0
    want = "timestamp-query" if "timestamp-query" in be.capabilities.features else "wall"
    assert be.last_timings["timer"] == want and be.last_timings[f"{what}_bytes"] == 1 << 20


def test_pooled_buffers_grow_and_shrink_across_calls_without_stale_data(WgpuBackend):
    """A small call after a large one reuses larger pooled buffers: only its own rows come back."""
    be = WgpuBackend(required_limits="default")
    fresh = WgpuBackend(required_limits="default")
    small = random_problem(5, seqlens_q=(1,), G=2, D=8, msb=2)
    large = random_problem(6, seqlens_q=(4, 3, 2), G=2, D=8, msb=4)
    for args in (small, large, small, large):
        got = _fwd(args, be, return_lse=True)
        want = _fwd(args, fresh if args is small else "numpy", return_lse=True)
        if args is small:  # same device kind, fresh pool: the same bits
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
        else:
            np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_geometry_is_chosen_per_call(WgpuBackend):
    be = WgpuBackend()  # adapter limits: the shapes below fit without halving
    decode = random_problem(7, seqlens_q=(1, 1), G=4, D=32, page_size=4, ppb=4, msb=3)
    _fwd(decode, be)
    g = be.last_timings["geometry"]
    from paged_sparse_attn.backends.wgpu._decode import DECODE

    # the decode kernel's default: one subgroup (key groups of R = 8 lanes: 8 units per row)
    assert g.kernel == DECODE and g.R == 8
    assert g.WG == max(g.R, be.capabilities.limits["measured_subgroup_size"])
    prefill = random_problem(8, seqlens_q=(12,), G=4, D=64, page_size=4, ppb=4, msb=3, topk=3, used="full")
    _fwd(prefill, be)
    g = be.last_timings["geometry"]
    assert g.WG == 256 and g.RMAX > 16
    fixed = WgpuBackend(workgroup_size=64)
    _fwd(prefill, fixed)
    assert fixed.last_timings["geometry"].WG == 64


def test_ceilings_and_profiling_without_timestamps_use_the_wall_clock(WgpuBackend):
    """A device without timestamp queries: copy / read bandwidth and profile_forward fall back
    to host time around submit and wait (and say so)."""
    be = WgpuBackend(required_limits="default", disable_features=("timestamp-query",))
    assert "timestamp-query" not in be.capabilities.features
    assert be.copy_bandwidth(1 << 20, repeat=2) > 0 and be.last_timings["timer"] == "wall"
    assert be.read_bandwidth(1 << 20, repeat=2, warmup_s=0.01) > 0 and be.last_timings["timer"] == "wall"
    args = random_problem(9, seqlens_q=(2, 1), G=2, D=16, page_size=2, ppb=2, msb=4, causal=True)
    kd, vd = be.upload_kv_cache(args.k_cache, args.v_cache)
    p, idx = _problem_and_index(args, kd, vd)
    prof = be.profile_forward(p, idx, repeat=2, replay=3)
    assert prof["timer"] == "wall" and prof["total_s"] > 0 and prof["replay"] == 3
    assert prof["call_s"] is None  # no timestamps: no one-pass GPU time


def test_matmul_rate_needs_subgroup_matrices(WgpuBackend):
    """wgpu-native has no subgroup matrices: the matmul ceiling is unsupported, not zero."""
    from paged_sparse_attn import UnsupportedError

    be = WgpuBackend(required_limits="default")
    with pytest.raises(UnsupportedError, match="subgroup"):
        be.matmul_rate(256, repeat=1)


def test_gemm_variants_are_skipped_where_they_do_not_fit():
    """The host runs a GEMM variant only where its workgroup memory, invocations, subgroup size
    and block fit; the list always keeps the naive kernel and a tiled one within WebGPU's
    default limits (16 KiB, 256 invocations), and every variant fits the bench's shape on an
    H200 (``GEMM_SIZE``, a multiple of every block)."""
    from types import SimpleNamespace

    from paged_sparse_attn.backends.wgpu._ceilings import GEMM_VARIANTS
    from paged_sparse_attn.bench.gpu import GEMM_SIZE as S

    small = SimpleNamespace(workgroup_storage=16384, max_invocations=256, subgroup=(32, ""))
    h200 = SimpleNamespace(workgroup_storage=49152, max_invocations=1024, subgroup=(32, ""))
    wave64 = SimpleNamespace(workgroup_storage=49152, max_invocations=1024, subgroup=(64, ""))
    fit = {name: [v.name for v in GEMM_VARIANTS if v.unfit(ctx, S, S, S) is None]
           for name, ctx in (("small", small), ("h200", h200), ("wave64", wave64))}
    assert fit["h200"] == [v.name for v in GEMM_VARIANTS]
    assert any(n.startswith("tiled") for n in fit["small"]) and any(n.startswith("naive") for n in fit["small"])
    assert all(n.startswith("naive") for n in fit["wave64"])
    for v in GEMM_VARIANTS:
        bm, bn, bk = v.block
        why = v.unfit(small, S, S, S)
        assert (why is None) == (v.workgroup_bytes <= 16384 and v.invocations <= 256)
        assert v.unfit(h200, bm * 3, bn * 2, bk * 5) is None
        if bm > 16:
            assert "multiple of the block" in v.unfit(h200, bm * 3 + 16, bn, bk)
        if v.tiled:  # the kernel's divisibility and register-array assumptions
            c = v.c
            wg = v.invocations
            assert (bm * bk // 8) % wg == 0 and (bk * bn // 8) % wg == 0
            assert (bm * bk // 8) // wg <= 8 and (bk * bn // 8) // wg <= 8
            assert c["TM"] <= 4 and c["TN"] <= 4 and bk % 16 == 0 and c["STAGES"] in (1, 2)
