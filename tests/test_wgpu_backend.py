"""The wgpu backend against the numpy backend and the float64 dense reference.

These tests require the backend (CI installs lavapipe, Mesa's CPU Vulkan driver): a missing
driver is a failure, not a skip. Devices are opened with WebGPU's *default* limits (8 storage
buffers per stage, 128 MiB bindings, 16 KiB workgroup memory) so that portability bugs show up.
Shapes are small: lavapipe on a CI runner is slow.

Tolerances come from the dtype (``paged_sparse_attn.testing.tolerance``, R20), never from per-test constants.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.errors import DeviceError, SpecError, UnsupportedError

from paged_sparse_attn.testing import assert_attention_close, tolerance
from paged_sparse_attn.testing.generate import random_problem

# A binding limit small enough to split every cache below into several chunks and every call
# into several batches, large enough for one (query, KV head) row of these problems.
SPLIT_BINDING = 2048


@pytest.fixture(scope="session")
def be(WgpuBackend):
    return WgpuBackend(required_limits="default")


@pytest.fixture(scope="session")
def be_split(WgpuBackend):
    """Cache chunks and batches of at most SPLIT_BINDING bytes; 2 x 2 workgroups per dispatch."""
    return WgpuBackend(required_limits="default", max_binding_size=SPLIT_BINDING, max_workgroups_per_dim=2)


@pytest.fixture(scope="session")
def be_split_wide(WgpuBackend):
    """Like be_split with room for rows of G = 8, D = 33: chunks, batches, 3 x 3 grids."""
    return WgpuBackend(required_limits="default", max_binding_size=8192, max_workgroups_per_dim=3)


@pytest.fixture(scope="session")
def be_nof16(WgpuBackend):
    return WgpuBackend(required_limits="default", disable_features=("shader-f16",))


def _out_tol(ref: np.ndarray, dtype) -> float:
    return tolerance(dtype).out * max(1.0, float(np.abs(ref).max(initial=0.0)))


def check(pb, backend):
    """wgpu == dense_reference (dtype tolerance) and == numpy backend; returns (out, lse)."""
    dtype = pb.k_cache.dtype
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    out, lse = psa.forward(*pb.args, **pb.options, backend=backend, return_lse=True)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert_attention_close(out, ref, dtype=dtype, lse=lse, ref_lse=ref_lse, err_msg="wgpu")
    out_np, lse_np = psa.forward(*pb.args, **pb.options, backend="numpy", return_lse=True)
    np.testing.assert_allclose(out, out_np, rtol=0, atol=_out_tol(out_np, np.float32))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_np))
    return out, lse


def index_of(pb):
    return pb.build_index()


def assert_partials_match(p_gpu, p_np):
    """Partials agree: same empty edges (m = -inf, l = 0, o = 0), float32-close elsewhere (R14)."""
    assert p_gpu.o.shape == p_np.o.shape and p_gpu.m.shape == p_np.m.shape
    np.testing.assert_array_equal(np.isneginf(p_gpu.m), np.isneginf(p_np.m))
    np.testing.assert_array_equal(p_gpu.l == 0, p_np.l == 0)
    empty = p_np.l == 0
    assert (p_gpu.o[empty] == 0).all()
    tol = tolerance(np.float32).out
    live = ~empty
    np.testing.assert_allclose(p_gpu.m[live], p_np.m[live], rtol=tol, atol=tol)
    np.testing.assert_allclose(p_gpu.l[live], p_np.l[live], rtol=tol)
    np.testing.assert_allclose(p_gpu.o, p_np.o, rtol=0, atol=_out_tol(p_np.o, np.float32))


# --- availability, import hygiene, options ---------------------------------------------------


def test_R18_probe_reports_the_adapter_and_is_cached(WgpuBackend):
    a = WgpuBackend.probe()
    assert a.ok and a.reason.startswith("ok: ")
    assert WgpuBackend.probe() is a


def test_importing_the_package_does_not_import_wgpu():
    code = ("import sys, paged_sparse_attn as psa; "
            "assert 'wgpu' not in sys.modules, 'wgpu imported'; "
            "assert 'paged_sparse_attn.backends.wgpu' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_builds_the_wgpu_backend(WgpuBackend):
    assert isinstance(psa.get_backend("wgpu"), WgpuBackend)
    assert psa.list_backends()["wgpu"].ok


def test_R18_capabilities_report_dtypes_limits_and_features(be):
    caps = be.capabilities
    assert caps.dtypes == ("float32", "float16") and "shader-f16" in caps.features
    assert caps.device_arrays and caps.deterministic
    assert caps.max_head_dim == 256 and caps.max_page_size == 128
    assert caps.limits["max-storage-buffers-per-shader-stage"] == 8  # WebGPU default requested
    assert caps.limits["max-compute-workgroup-storage-size"] == 16384
    assert caps.limits["max-storage-buffer-binding-size"] == 128 << 20
    assert caps.limits["measured_subgroup_size"] in (8, 16, 32, 64)  # lavapipe 8, NVIDIA 32
    assert caps.device


def test_constructor_rejects_bad_options(WgpuBackend):
    with pytest.raises(ValueError, match="required_limits"):
        WgpuBackend(required_limits="huge")
    with pytest.raises(ValueError, match="power_preference"):
        WgpuBackend(power_preference="fast")
    with pytest.raises(ValueError, match="max_binding_size"):
        WgpuBackend(required_limits="default", max_binding_size=8)
    with pytest.raises(ValueError, match="workgroup_size"):
        WgpuBackend(required_limits="default", workgroup_size=32)


def test_shaders_are_found_and_specialised_for_float16():
    from paged_sparse_attn.backends.wgpu._shaders import shader_path, shader_source

    for name in ("psa_partials.wgsl", "psa_merge.wgsl"):
        assert shader_path(name).endswith(name)
    src = shader_source("psa_partials.wgsl", f16=True)
    assert src.startswith("enable f16;") and "alias kv_t = f16;" in src


@pytest.mark.parametrize("D, dv", [(8, 4), (6, 2), (5, 1)])
def test_the_combine_on_several_components_per_invocation_gives_the_same_bits(WgpuBackend, monkeypatch, D, dv):
    """psa_merge.wgsl takes DV components per invocation where the dispatch is wide (prefill: 4,
    measured faster on an H200); CI's problems are narrow, so the width is lowered here: both
    paths (forward with host arrays, a plan on resident caches) give the bits of one component
    per invocation, rows of more than one chunk of 8 elements included."""
    from paged_sparse_attn.backends.wgpu import _resident

    pb = random_problem(7, seqlens_q=(9, 4), Hkv=2, G=3, D=D, page_size=2, ppb=2, msb=12, causal=False,
                        dtype=np.float32, q_dtype=np.float32)
    q, k, v, bt, sel, cu = pb.args
    assert sel.shape[2] > 8  # (the merge's chunks of 8: rescaled between them)
    runs = {}
    for wide in (1, 1 << 40):
        monkeypatch.setattr(_resident, "MERGE_WIDE", wide)
        assert _resident.merge_constants(D, 26)["DV"] == (dv if wide == 1 else 1)
        be = WgpuBackend()
        try:
            out, lse = psa.forward(*pb.args, **pb.options, backend=be, return_lse=True)
            kd, vd = be.upload_kv_cache(k, v)
            plan = psa.plan_attention(bt, cu, pb.options["used_kv_lens"], block_size=pb.options["block_size"],
                                      page_size=2, num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=D,
                                      kv_dtype=k.dtype, topk=sel.shape[2], softmax_scale=pb.options["softmax_scale"],
                                      backend=be)
            runs[wide] = (out, lse, plan.run(q, kd, vd, sel))
            plan.close()
        finally:
            be.close()
    (o1, l1, p1), (o2, l2, p2) = runs.values()
    assert o1.tobytes() == o2.tobytes() and l1.tobytes() == l2.tobytes() and p1.tobytes() == p2.tobytes()
    ref = psa.forward(*pb.args, **pb.options, backend="numpy")
    assert_attention_close(o1, ref, dtype=np.float32)


# --- the grid: wgpu == numpy == dense reference (R9-R11, R13-R15, R20) -------------------------

GRID = {
    "G1-D1-page1": dict(G=1, D=1, page_size=1, ppb=4, msb=3, seqlens_q=(3, 0, 2)),
    "G3-D5-page2": dict(G=3, D=5, page_size=2, ppb=3, msb=3, seqlens_q=(2, 3)),
    "G8-D64-page4": dict(G=8, D=64, page_size=4, ppb=2, msb=3, Hkv=1, seqlens_q=(3, 1)),
    "G2-D256-page1": dict(G=2, D=256, page_size=1, ppb=3, msb=2, Hkv=1, seqlens_q=(2, 1)),
    "G8-D256-headsplit": dict(G=8, D=256, page_size=2, ppb=1, msb=2, Hkv=1, seqlens_q=(1, 2)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(GRID))
def test_R9_R11_R20_forward_matches_numpy_and_dense_reference(be, name, causal, dtype):
    seed = 10 * list(GRID).index(name) + 2 * causal + (dtype is np.float16)
    pb = random_problem(seed, causal=causal, dtype=dtype, used="random", **GRID[name])
    assert pb.poisoned_cells > 0  # unattended memory holds NaN / Inf (R10)
    check(pb, be)


def test_R10_nan_in_unmapped_pages_beyond_L_and_unselected_blocks_never_leaks(be):
    S, ppb, msb, D, Hkv = 2, 2, 3, 4, 1
    BS = S * ppb
    rng = np.random.default_rng(7)
    P = 6
    k = rng.standard_normal((P, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((P, Hkv, S, D)).astype(np.float32)
    # logical pages 0..5; page 1 unmapped; L = 9 ends inside logical page 4 (block 2)
    bt = np.array([[3, -1, 0, 5, 2, 4]], dtype=np.int32)
    L = 9
    k[5], v[5] = np.nan, np.nan  # block 1 (logical pages 2, 3 -> physical 0, 5): not selected...
    k[0], v[0] = np.inf, -np.inf  # ...by anyone
    k[2, :, 1], v[2, :, 1] = np.nan, np.nan  # position 9 >= L in the last mapped page
    k[4], v[4] = np.nan, np.nan  # logical page 5: past L entirely
    k[1], v[1] = np.nan, np.nan  # physical page 1: mapped nowhere
    q = rng.standard_normal((2, 2, D)).astype(np.float32)
    sel = np.array([[[0, 2]], [[2, -1]]], dtype=np.int32)
    args = (q, k, v, bt, sel, np.array([0, 2], dtype=np.int32))
    kw = dict(used_kv_lens=np.array([L], dtype=np.int32), block_size=BS)
    ref, ref_lse = psa.dense_reference(*args, **kw)
    out, lse = psa.forward(*args, **kw, backend=be, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_attention_close(out, ref, dtype=np.float32, lse=lse, ref_lse=ref_lse)


def test_R9_causal_queries_before_the_cache_start_see_nothing(be):
    # T_b = 5 > L_b = 3: right-aligned causal gives queries 0 and 1 nothing (L - T + i < 0)
    pb = random_problem(3, seqlens_q=(5,), Hkv=2, G=2, D=8, page_size=2, ppb=2, msb=2, used=[3],
                      causal=True, fill=1.0, hole_prob=0.0)
    out, lse = check(pb, be)
    assert np.isneginf(lse[:2]).all() and (out[:2] == 0).all()
    assert np.isfinite(lse[2:]).all()


def test_R11_empty_rows_are_exactly_zero_with_lse_minus_inf(be):
    pb = random_problem(4, seqlens_q=(2, 2), Hkv=2, G=2, D=6, page_size=2, ppb=2, msb=3, used=[0, 12])
    pb.selected[1] = -1  # query 1 selects nothing
    out, lse = check(pb, be)
    assert (out[:2] == 0).all() and np.isneginf(lse[:2]).all()  # L_b = 0 and no selection
    nothing = pb.replace(selected=np.full_like(pb.selected, -1))  # no edge at all
    out, lse = psa.forward(*nothing.args, **nothing.options, backend=be, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_R12_logits_near_minus_1e6_are_exact(be):
    # Integer data, scale 1: every score is -1e6 + j (j small), exact in float32. A finite
    # "minus infinity" sentinel (FlashInfer's -5e4) would zero these rows.
    S, D, T, P = 4, 2, 3, 4
    rng = np.random.default_rng(12)
    k = np.zeros((P, 1, S, D), dtype=np.float32)
    k[..., 0] = -1000.0
    k[..., 1] = rng.integers(0, 6, size=(P, 1, S))
    v = rng.integers(-4, 5, size=(P, 1, S, D)).astype(np.float32)
    q = np.tile(np.array([1000.0, 1.0], dtype=np.float32), (T, 2, 1))
    bt = np.array([[2, 0, 3, 1]], dtype=np.int32)
    sel = np.array([[[0, 1]], [[2, 3]], [[3, -1]]], dtype=np.int32)
    args = (q, k, v, bt, sel, np.array([0, T], dtype=np.int32))
    kw = dict(block_size=S, softmax_scale=1.0)
    ref, ref_lse = psa.dense_reference(*args, **kw)
    out, lse = psa.forward(*args, **kw, backend=be, return_lse=True)
    assert (ref_lse < -9.9e5).all() and (np.abs(ref).max(axis=-1) > 0).all()
    assert_attention_close(out, ref, dtype=np.float32)
    ulp = float(np.spacing(np.float32(1e6)))
    assert np.abs(lse.astype(np.float64) - ref_lse).max() <= 2 * ulp


@pytest.mark.parametrize("seed", range(12))
def test_R9_R14_R20_seeded_random_problems_on_the_default_and_split_paths(be, be_split_wide, seed):
    rng = np.random.default_rng(seed)
    kw = dict(G=int(rng.choice([1, 2, 3, 8])), D=int(rng.choice([1, 3, 8, 12, 33])),
              page_size=int(rng.choice([1, 2, 3])), ppb=int(rng.integers(1, 4)), msb=int(rng.integers(1, 4)),
              Hkv=int(rng.integers(1, 3)), seqlens_q=tuple(int(x) for x in rng.integers(0, 4, size=3)),
              causal=bool(seed % 2), dtype=[np.float32, np.float16][seed % 3 == 2],
              used=["random", "full", "default"][seed % 3])
    pb = random_problem(500 + seed, **kw)
    idx = index_of(pb)
    p_np = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend="numpy")
    for backend in (be, be_split_wide):
        check(pb, backend)
        assert_partials_match(psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=backend), p_np)


def test_timestamps_report_kernel_times(WgpuBackend):
    be_ts = WgpuBackend(required_limits="default", timestamps=True)
    pb = random_problem(60, seqlens_q=(2, 2), used="full")
    psa.forward(*pb.args, **pb.options, backend=be_ts)
    t = be_ts.last_timings
    # the phases are disjoint parts of the call: together they cannot exceed its total
    phases = ("cache_s", "plan_s", "encode_s", "gpu_wait_s", "readback_s")
    assert 0 < sum(t[key] for key in phases) <= t["total_s"] + 1e-9, {k: t[k] for k in (*phases, "total_s")}
    if "timestamp-query" in be_ts.capabilities.features:
        assert t["gpu_partials_s"] > 0 and t["gpu_merge_s"] > 0


# --- partials and combine (R14, R15) -----------------------------------------------------------


@pytest.mark.parametrize("which", ["default", "split"])
def test_R14_forward_partials_match_the_numpy_backend(be, be_split, which):
    backend = be if which == "default" else be_split
    for seed, kw in enumerate([dict(G=3, D=5, page_size=2, ppb=3, msb=3),
                               dict(G=1, D=8, page_size=1, ppb=4, msb=2, causal=True)]):
        pb = random_problem(40 + seed, seqlens_q=(3, 2), **kw)
        idx = index_of(pb)
        assert idx.num_edges > 0
        p_gpu = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=backend)
        p_np = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend="numpy")
        assert p_gpu.o.dtype == p_gpu.m.dtype == p_gpu.l.dtype == np.float32
        assert_partials_match(p_gpu, p_np)


def test_R14_an_edge_on_unmapped_pages_only_is_empty(be):
    pb = random_problem(5, seqlens_q=(2,), Hkv=1, G=2, D=4, page_size=2, ppb=2, msb=2, used="full",
                      hole_prob=0.0, fill=1.0)
    pb.block_tables[0, 0:2] = -1  # block 0 entirely unmapped
    idx = index_of(pb)
    p = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=be)
    blk0 = idx.edge_block == 0
    assert blk0.any()
    assert np.isneginf(p.m[blk0]).all() and (p.l[blk0] == 0).all() and (p.o[blk0] == 0).all()
    assert (p.l[~blk0] >= 1).all()  # non-empty partials have l >= 1
    check(pb, be)


def test_R15_gpu_combine_equals_combine_of_gpu_partials(be):
    pb = random_problem(6, seqlens_q=(3, 1), Hkv=2, G=3, D=7, page_size=2, ppb=2, msb=4)
    idx = index_of(pb)
    out, lse = psa.forward(*pb.args, **pb.options, backend=be, return_lse=True)
    out2, lse2 = psa.combine_partials(psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=be), idx)
    np.testing.assert_allclose(out, out2, rtol=0, atol=_out_tol(out2, np.float32))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse2))
    fin = np.isfinite(lse2)
    np.testing.assert_allclose(lse[fin], lse2[fin], rtol=tolerance(np.float32).out)


# --- R18: float16 without shader-f16 -----------------------------------------------------------


def test_R18_float16_raises_unsupported_without_shader_f16(be_nof16):
    assert be_nof16.capabilities.dtypes == ("float32",)
    assert "shader-f16" not in be_nof16.capabilities.features
    pb = random_problem(8, dtype=np.float16, q_dtype=np.float32)
    with pytest.raises(UnsupportedError, match="float16"):
        psa.forward(*pb.args, **pb.options, backend=be_nof16)
    with pytest.raises(UnsupportedError, match="shader-f16"):
        be_nof16.upload_kv_cache(pb.k_cache, pb.v_cache)
    check(random_problem(8), be_nof16)  # float32 still runs


# --- size limits: binding split, batches, dispatch grids ------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_binding_split_and_batches_match_the_reference(be_split, dtype):
    from paged_sparse_attn.backends.wgpu import _plan

    pb = random_problem(21, seqlens_q=(4, 3), Hkv=2, G=2, D=16, page_size=2, ppb=3, msb=4, dtype=dtype,
                      used="full", causal=True, spare_pages=4)
    k_dev, v_dev = be_split.upload_kv_cache(pb.k_cache, pb.v_cache)
    assert k_dev.layout.n_chunks >= 2  # the cache is split across several bindings
    # and a call is split into several batches
    idx = index_of(pb)
    view = _plan.IndexView(idx, 2)
    geom = _plan.choose_geometry(D=16, S=2, G=2, block_size=6, rows_needed=8, kv_itemsize=k_dev.dtype.itemsize,
                                 wg_size=64, wg_storage=16384)
    assert len(_plan.plan_forward(view, geom, k_dev.layout.slab_map(), SPLIT_BINDING)) > 1
    check(pb, be_split)  # host caches: compact upload, split
    out = psa.forward(pb.q, k_dev, v_dev, *pb.args[3:], **pb.options)  # resident caches, split
    ref = psa.dense_reference(*pb.args, **pb.options)[0]
    assert_attention_close(out, ref, dtype=dtype)


def test_planner_unique_helpers_equal_numpy_unique():
    """The planner's sort-based unique (numpy 2's hash-based np.unique was 12 times slower on a
    decode step's keys) returns what np.unique returns, inverse included."""
    from paged_sparse_attn.backends.wgpu._plan import unique_inverse, unique_sorted

    rng = np.random.default_rng(5)
    for n, hi in [(0, 1), (1, 3), (7, 2), (4096, 4096), (5000, 10**12)]:
        a = rng.integers(-hi, hi, size=n, dtype=np.int64)
        u, inv = np.unique(a, return_inverse=True)
        np.testing.assert_array_equal(unique_sorted(a), u)
        u2, inv2 = unique_inverse(a)
        np.testing.assert_array_equal(u2, u)
        np.testing.assert_array_equal(inv2, inv.reshape(-1))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_one_batch_bound_with_several_chunks_is_conservative(be_split, dtype):
    """With several cache chunks the planner takes one batch without per-row costs when a closed
    bound (every edge split into min(chunks, pages per block) pieces) fits; the plans it makes
    then are those of the per-row path, whose exact costs fit as well."""
    from paged_sparse_attn.backends.wgpu import _plan

    pb = random_problem(22, seqlens_q=(1,) * 6, Hkv=2, G=2, D=16, page_size=2, ppb=3, msb=4, dtype=dtype,
                      used="random")
    k_dev, v_dev = be_split.upload_kv_cache(pb.k_cache, pb.v_cache)
    smap = k_dev.layout.slab_map()
    assert smap.n_chunks >= 2
    view = _plan.IndexView(index_of(pb), 2)
    geom = _plan.choose_geometry(D=16, S=2, G=2, block_size=6, rows_needed=4, kv_itemsize=k_dev.dtype.itemsize,
                                 wg_size=64, wg_storage=16384)
    big = 1 << 30
    caps = _plan._caps(geom, big)
    n_rows = view.index.num_queries * view.Hkv
    assert _plan._fits_one_batch(view, geom, smap.n_chunks, n_rows, *caps)
    plans = _plan.plan_forward(view, geom, smap, big)
    assert len(plans) == 1
    # the exact per-row costs agree: one range
    rprows, rplan = _plan._edge_costs(view, geom, smap, view.index.row_edges.astype(np.int64))
    assert rprows.sum() <= caps[0] and rplan.sum() <= caps[1]
    assert plans[0].n_prows <= rprows.sum()
    out = psa.forward(pb.q, k_dev, v_dev, *pb.args[3:], **pb.options, backend=be_split)
    assert_attention_close(out, psa.dense_reference(*pb.args, **pb.options)[0], dtype=dtype)


def test_dispatch_grids_split_past_the_workgroup_limit():
    from paged_sparse_attn.backends.wgpu._plan import grid_dispatches

    assert list(grid_dispatches(70000, 65535)) == [(0, 70000, 65535, 2)]
    assert list(grid_dispatches(10, 3)) == [(0, 9, 3, 3), (9, 1, 1, 1)]
    for n, m in [(1, 1), (5, 1), (65536, 256), (100, 7)]:
        parts = list(grid_dispatches(n, m))
        assert sum(c for _, c, _, _ in parts) == n
        assert all(gx <= m and gy <= m and gx * gy >= c for _, c, gx, gy in parts)


def test_more_work_items_than_the_dispatch_limit(be_split):
    # 2 x 2 workgroups per dispatch: dozens of dispatches for the partials and the combine
    pb = random_problem(22, seqlens_q=(3, 3), Hkv=2, G=1, D=3, page_size=1, ppb=2, msb=5, used="full")
    assert index_of(pb).num_edges > 4
    check(pb, be_split)


# --- device-resident caches --------------------------------------------------------------------


@pytest.mark.parametrize("which", ["default", "split"])
def test_device_resident_cache_is_reused_and_updated(be, be_split, which):
    backend = be if which == "default" else be_split
    pb = random_problem(30, seqlens_q=(2, 2), Hkv=2, G=2, D=5, page_size=3, ppb=2, msb=3,
                      dtype=np.float16, used="full", poison=False)
    k_dev, v_dev = backend.upload_kv_cache(pb.k_cache, pb.v_cache)
    assert k_dev.shape == pb.k_cache.shape and k_dev.dtype == np.float16 and k_dev.backend is backend
    np.testing.assert_array_equal(k_dev.to_numpy(), pb.k_cache)  # odd S*D: padded slabs round-trip
    rng = np.random.default_rng(0)
    for step in range(2):  # the same resident cache, different queries and selections
        q = rng.standard_normal(pb.q.shape).astype(np.float32)
        sel = np.where(rng.random(pb.selected.shape) < 0.3, -1, pb.selected)
        args = (q, k_dev, v_dev, pb.block_tables, sel, pb.cu_seqlens_q)
        out, lse = psa.forward(*args, **pb.options, return_lse=True)  # backend: the cache's owner
        host = (q, pb.k_cache, pb.v_cache, pb.block_tables, sel, pb.cu_seqlens_q)
        ref, ref_lse = psa.dense_reference(*host, **pb.options)
        assert_attention_close(out, ref, dtype=np.float16, lse=lse, ref_lse=ref_lse)
    # write new tokens into two pages, as a decode loop does
    pages = np.array([int(pb.block_tables[0, 0]), int(pb.block_tables[1, 1])])
    pages = pages[pages >= 0]
    k_new = rng.standard_normal((pages.size,) + pb.k_cache.shape[1:]).astype(np.float16)
    v_new = rng.standard_normal((pages.size,) + pb.k_cache.shape[1:]).astype(np.float16)
    backend.update_pages(k_dev, v_dev, pages, k_new, v_new)
    pb.k_cache[pages], pb.v_cache[pages] = k_new, v_new
    np.testing.assert_array_equal(v_dev.to_numpy(), pb.v_cache)
    out = psa.forward(pb.q, k_dev, v_dev, *pb.args[3:], **pb.options)
    assert_attention_close(out, psa.dense_reference(*pb.args, **pb.options)[0], dtype=np.float16)
    k_dev.release()
    with pytest.raises(DeviceError, match="released"):
        psa.forward(pb.q, k_dev, v_dev, *pb.args[3:], **pb.options)
    v_dev.release()


def test_one_resident_and_one_host_cache(be):
    pb = random_problem(31, seqlens_q=(2, 1), used="full")
    k_dev, v_dev = be.upload_kv_cache(pb.k_cache, pb.v_cache)
    ref = psa.dense_reference(*pb.args, **pb.options)[0]
    out = psa.forward(pb.q, k_dev, pb.v_cache, *pb.args[3:], **pb.options)
    assert_attention_close(out, ref, dtype=np.float32)
    out = psa.forward(pb.q, pb.k_cache, v_dev, *pb.args[3:], **pb.options)
    assert_attention_close(out, ref, dtype=np.float32)


def test_R18_a_cache_of_another_backend_instance_is_refused(be, be_split):
    pb = random_problem(32, used="full")
    k_dev, v_dev = be_split.upload_kv_cache(pb.k_cache, pb.v_cache)
    with pytest.raises(UnsupportedError):
        psa.forward(pb.q, k_dev, v_dev, *pb.args[3:], **pb.options, backend=be)


def test_update_pages_validates_its_arguments(be):
    pb = random_problem(33, used="full")
    k_dev, v_dev = be.upload_kv_cache(pb.k_cache, pb.v_cache)
    P = pb.k_cache.shape[0]
    good = pb.k_cache[:1]
    with pytest.raises(SpecError, match="page_ids"):
        be.update_pages(k_dev, v_dev, [P], good, good)
    with pytest.raises(SpecError, match="pages"):
        be.update_pages(k_dev, v_dev, [0], good.astype(np.float16), good)


# --- determinism and errors --------------------------------------------------------------------


def test_R19_same_inputs_give_the_same_bits(be, be_split):
    pb = random_problem(50, seqlens_q=(3, 2), Hkv=2, G=3, D=9, page_size=2, ppb=2, msb=3)
    for backend in (be, be_split):
        a = psa.forward(*pb.args, **pb.options, backend=backend, return_lse=True)
        b = psa.forward(*pb.args, **pb.options, backend=backend, return_lse=True)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
        idx = index_of(pb)
        p1 = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=backend)
        p2 = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=backend)
        assert p1.o.tobytes() == p2.o.tobytes() and p1.m.tobytes() == p2.m.tobytes()


def test_device_failures_become_DeviceError_with_context(be):
    from paged_sparse_attn.backends.wgpu._device import device_errors

    with pytest.raises(DeviceError, match=r"test allocation.*bytes=1152921504606846976"):
        with device_errors("test allocation", bytes=1 << 60):
            be.device_context.device.create_buffer(size=1 << 60, usage=0x80)


def test_workgroup_memory_is_checked_against_the_limit():
    from paged_sparse_attn.backends.wgpu._plan import choose_geometry

    for limit in (16384, 32768, 49152):
        for D in (1, 2, 5, 31, 32, 33, 64, 100, 128, 255, 256):
            for itemsize in (2, 4):
                for wg in (64, 256):
                    g = choose_geometry(D=D, S=4, G=8, block_size=64, rows_needed=512,
                                        kv_itemsize=itemsize, wg_size=wg, wg_storage=limit)
                    assert g.workgroup_bytes <= limit
                    assert 4 * g.TD >= D and g.TD * g.TR <= wg and g.RMAX <= 4 * g.TR
