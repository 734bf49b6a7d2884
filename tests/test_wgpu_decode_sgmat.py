"""The tensor-core decode partials kernel (``psa_partials_decode_sgmat.wgsl``).

Host side, on every run (no GPU needed): the kernel table row, where the host picks the kernel
and why it refuses, and its workgroup memory as Tint counts it (Dawn's Null adapter).

Device side, on a backend whose device has 16x8x16 float16 subgroup matrices and subgroups of 32
(``--backend dawn`` on an NVIDIA GPU): every problem runs with
``partials_kernel="decode_sgmat"`` (an ineligible problem fails instead of running another
kernel), the kernel that ran is checked, and results are compared with the numpy backend and the
dense reference: random decode problems (lengths that end inside a 16-key tile, unmapped pages,
empty rows, GQA groups of 1 to 16 heads, split cache bindings, NHD caches), NaN and infinities in
q, K and V and removed positions (R26), determinism (R19) and the planned layer. Devices without
subgroup matrices (lavapipe in continuous integration) skip the device tests: they are run, and
their counts recorded, on such a device.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends.wgpu._decode import (
    DECODE_SGMAT,
    DECODE_SGMAT_BYTES,
    DecodeSgmatGeometry,
    choose_decode_sgmat_geometry,
    decode_sgmat_ineligible,
)
from paged_sparse_attn.backends.wgpu._kernels import KERNEL_TABLE
from paged_sparse_attn.errors import UnsupportedError
from paged_sparse_attn.testing import assert_attention_close, tolerance
from paged_sparse_attn.testing.generate import random_problem

# --- host side ---------------------------------------------------------------------------------


def _ctx(**kw):
    base = dict(sgmat=frozenset({(16, 16, 16), (16, 8, 16)}), subgroup=(32, ""), workgroup_storage=49152,
                max_invocations=1024)
    return SimpleNamespace(**{**base, **kw})


def _why(ctx=None, **kw):
    args = dict(D=128, kv_itemsize=2, page_size=64, block_size=128)
    return decode_sgmat_ineligible(ctx or _ctx(), **{**args, **kw})


def test_kernel_table_row_is_a_drop_in_for_the_decode_kernel():
    row, fma = KERNEL_TABLE[DECODE_SGMAT], KERNEL_TABLE["psa_partials_decode.wgsl"]
    assert row.sgmat and row.shape == (16, 8, 16) and row.trusted
    assert row.bindings == fma.bindings  # same bindings, params and plan: one host path


def test_the_msa_decode_shape_is_eligible():
    assert _why() is None
    g = choose_decode_sgmat_geometry(D=128, S=64, G=8)
    assert isinstance(g, DecodeSgmatGeometry) and g.kernel_name == DECODE_SGMAT
    assert g.RMAX == 8 and g.edges_per_item == 1 and g.constants() == {"D": 128, "S": 64, "WG": 128}
    assert choose_decode_sgmat_geometry(D=64, S=16, G=16).RMAX == 8  # larger groups: items of 8 heads


@pytest.mark.parametrize("kw, reason", [
    (dict(ctx=_ctx(sgmat=frozenset())), "16x8x16"),
    (dict(ctx=_ctx(sgmat=frozenset({(16, 16, 16)}))), "16x8x16"),
    (dict(kv_itemsize=4), "not float16"),
    (dict(D=136), "multiple of 16 up to 128"),
    (dict(D=40), "multiple of 16 up to 128"),
    (dict(page_size=8), "page_size 8 is not a multiple of 16"),
    (dict(block_size=256), "block_size 256 > 128"),
    (dict(ctx=_ctx(subgroup=(64, ""))), "subgroup size is 64"),
    (dict(ctx=_ctx(subgroup=(None, "not measured"))), "subgroup size is None"),
    (dict(ctx=_ctx(workgroup_storage=16384)), "25824 bytes of workgroup memory"),
    (dict(ctx=_ctx(max_invocations=64)), "64 invocations"),
])
def test_refusals_name_why(kw, reason):
    why = _why(**kw)
    assert why is not None and reason in why


def test_workgroup_size_choices():
    assert choose_decode_sgmat_geometry(D=128, S=64, G=8, wg_size=256).WG == 256
    with pytest.raises(UnsupportedError, match="128 or 256.*got 64.*R18"):
        choose_decode_sgmat_geometry(D=128, S=64, G=8, wg_size=64)


def test_workgroup_memory_is_what_tint_counts(tint_device):
    """The host's count (the eligibility check against the device's limit) equals what Tint
    reports for the pipeline; Dawn's Null adapter (16 KiB) refuses it naming that size."""
    from paged_sparse_attn.backends.wgpu._kernels import kernel_source

    device, ctx = tint_device
    module = device.create_shader_module(code=kernel_source(ctx, DECODE_SGMAT), label=DECODE_SGMAT)
    for c in ({"D": 128, "S": 64, "WG": 128}, {"D": 16, "S": 16, "WG": 256, "RH": 4}):
        with pytest.raises(Exception, match=rf"\({DECODE_SGMAT_BYTES} bytes\)"):
            device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main",
                                                                    "constants": c})
    assert re.search(rf"= {DECODE_SGMAT_BYTES} bytes", kernel_source(ctx, DECODE_SGMAT))


# --- device side -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mma(backend):
    """The selected backend's class, forced to the tensor-core decode kernel, where it can run."""
    ctx = getattr(backend, "device_context", None)
    if ctx is None:
        pytest.skip(f"backend {backend.name!r} has no WebGPU device")
    why = decode_sgmat_ineligible(ctx, D=128, kv_itemsize=2, page_size=16, block_size=128)
    if why is not None:
        pytest.skip(f"backend {backend.name!r}: {why}")
    return type(backend)(partials_kernel="decode_sgmat")


def _same_specials(a, b, what):
    """NaN and infinities at the same places; finite values float32-close (R26, R20)."""
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what}: NaN")
    np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=f"{what}: +inf")
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=f"{what}: -inf")
    fin = np.isfinite(b)
    scale = max(1.0, float(np.abs(b[fin]).max(initial=0.0)))
    np.testing.assert_allclose(a[fin], b[fin], rtol=0, atol=tolerance(np.float32).out * scale, err_msg=what)


def _check(args, kw, be, *, reference=True):
    out, lse = psa.forward(*args, **kw, backend=be, return_lse=True)
    assert be.last_timings["kernel"] == DECODE_SGMAT
    out_np, lse_np = psa.forward(*args, **kw, backend="numpy", return_lse=True)
    _same_specials(out, out_np, "out against the numpy backend")
    _same_specials(lse, lse_np, "lse against the numpy backend")
    if reference:
        ref, ref_lse = psa.dense_reference(*args, **kw)
        assert_attention_close(out, ref, dtype=args[1].dtype, lse=lse, ref_lse=ref_lse,
                               err_msg="tensor-core decode kernel")
    return out, lse


# (G, D, page_size, pages per block): GQA groups of 1..16 heads (16: two items of 8), head dims
# 16..128, blocks of 16..128 positions over 1..4 pages
GRID = [(1, 16, 16, 1), (3, 64, 16, 2), (8, 128, 64, 2), (8, 128, 16, 8), (16, 64, 32, 4), (4, 32, 128, 1)]


@pytest.mark.parametrize("G,D,S,ppb", GRID)
def test_R9_R10_R14_matches_numpy_and_the_reference(mma, G, D, S, ppb):
    # one query per sequence (an empty sequence too), random lengths (ends inside 16-key tiles),
    # unmapped pages, a row that selects nothing; unattended cells hold NaN / Inf
    pb = random_problem(2000 + G + D + S + ppb, seqlens_q=(1, 1, 0, 1, 1), Hkv=2, G=G, D=D, page_size=S,
                        ppb=ppb, msb=3, dtype=np.float16, used="random", hole_prob=0.2, fill=0.7)
    pb.selected[1] = -1
    assert pb.poisoned_cells > 0
    _check(pb.args, pb.options, mma)


@pytest.mark.parametrize("wg", [128, 256])
def test_R19_bitwise_deterministic_for_both_workgroup_sizes(backend, mma, wg):
    be = type(backend)(partials_kernel="decode_sgmat", decode_workgroup_size=wg)
    pb = random_problem(9, seqlens_q=(1, 1, 1), Hkv=2, G=8, D=128, page_size=16, ppb=8, msb=3,
                        dtype=np.float16, used="random", hole_prob=0.1)
    a, la = _check(pb.args, pb.options, be)
    assert be.last_timings["geometry"].WG == wg
    b, lb = psa.forward(*pb.args, **pb.options, backend=be, return_lse=True)
    assert a.tobytes() == b.tobytes() and la.tobytes() == lb.tobytes()


def test_R14_split_bindings_and_small_grids(backend, mma):
    # 64 KiB chunks: blocks span chunks (pages of another chunk are skipped, the pieces merged)
    be = type(backend)(partials_kernel="decode_sgmat", max_binding_size=65536, max_workgroups_per_dim=2)
    pb = random_problem(31, seqlens_q=(1,) * 6, Hkv=2, G=8, D=64, page_size=16, ppb=4, msb=3, dtype=np.float16,
                        used="random", hole_prob=0.15)
    _check(pb.args, pb.options, be)
    assert be.last_timings["chunks"] > 1


def test_R34_nhd_caches(mma):
    pb = random_problem(34, seqlens_q=(1, 1, 1), Hkv=4, G=8, D=64, page_size=32, ppb=2, msb=3, dtype=np.float16,
                        used="random", hole_prob=0.1)
    k = np.ascontiguousarray(pb.k_cache.transpose(0, 2, 1, 3))
    v = np.ascontiguousarray(pb.v_cache.transpose(0, 2, 1, 3))
    args = (pb.q, k, v, *pb.args[3:])
    out = psa.forward(*args, **{**pb.options, "kv_layout": "NHD"}, backend=mma)
    assert mma.last_timings["kernel"] == DECODE_SGMAT
    np.testing.assert_array_equal(out, psa.forward(*pb.args, **pb.options, backend=mma))


def test_R14_partials_are_close_to_the_numpy_backends(mma):
    pb = random_problem(5, seqlens_q=(1, 1, 1, 0, 1), Hkv=2, G=8, D=64, page_size=16, ppb=2, msb=3,
                        dtype=np.float16, used="random")
    idx = pb.build_index()
    a = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=mma)
    assert mma.last_timings["kernel"] == DECODE_SGMAT
    b = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend="numpy")
    np.testing.assert_array_equal(a.l == 0, b.l == 0)
    live = b.l != 0
    tol = tolerance(np.float32).out
    np.testing.assert_allclose(a.m[live], b.m[live], rtol=tol, atol=tol)
    np.testing.assert_allclose(a.l[live], b.l[live], rtol=tol)
    np.testing.assert_allclose(a.o, b.o, rtol=0, atol=tol * max(1.0, float(np.abs(b.o).max())))


def _special(case, L=29, G=8, D=16, S=16):
    """One sequence, one KV head, a block of 2 pages (two 16-key tiles, the second ending inside:
    L = 29), all selected; ``case`` puts special values where the kernel must handle them."""
    rng = np.random.default_rng(len(case))
    q = rng.standard_normal((1, G, D)).astype(np.float32)
    k = rng.standard_normal((2, 1, S, D)).astype(np.float16)
    v = rng.standard_normal((2, 1, S, D)).astype(np.float16)
    scale = None
    at = lambda pos: (pos // S, 0, pos % S)  # noqa: E731  (page, head, row) of block position pos
    if case == "nan_v":
        v[at(5) + (3,)] = np.nan
    elif case == "inf_v":
        v[at(20) + (0,)] = np.inf
    elif case == "inf_and_minus_inf_v":
        v[at(7) + (1,)] = -np.inf
        v[at(9) + (1,)] = np.inf
    elif case == "inf_k":  # +inf scores (NaN rows) for some heads, -inf (removed) for the others
        k[at(3) + (2,)] = np.inf
    elif case == "nan_k_in_the_staged_tile":
        k[at(21) + (0,)] = np.nan
    elif case == "nan_q":
        q[0, 2, 5] = np.nan
    elif case == "inf_q":
        q[0, 3, 0] = np.inf
    elif case == "removed_position_with_a_nan_value":
        # scale 1e37: position 4's score overflows to -inf (removed, its NaN value left out); the
        # other scores stay finite
        q = np.abs(q) + 0.5
        k = rng.uniform(-0.01, 0.01, size=k.shape).astype(np.float16)
        k[at(4)] = -8.0
        v[at(4) + (2,)] = np.nan
        scale = 1e37
    elif case == "huge_queries":  # q near the float32 limit: scaled into float16 range exactly
        q *= np.float32(1e36)
        scale = 1e-36
    elif case == "tiny_queries":
        q *= np.float32(1e-30)
        scale = 1e30
    else:
        raise AssertionError(case)
    args = (q, k, v, np.array([[1, 0]]), np.array([[[0]]]), np.array([0, 1]))
    return args, dict(block_size=2 * S, used_kv_lens=np.array([L]), softmax_scale=scale)


@pytest.mark.parametrize("case", ["nan_v", "inf_v", "inf_and_minus_inf_v", "inf_k", "nan_k_in_the_staged_tile",
                                  "nan_q", "inf_q", "removed_position_with_a_nan_value", "huge_queries",
                                  "tiny_queries"])
def test_R26_special_values_as_the_numpy_backend(mma, case):
    args, kw = _special(case)
    out, _ = _check(args, kw, mma, reference=False)
    # the cases are not vacuous: special values reach the output exactly where the spec puts them
    finite = case in ("removed_position_with_a_nan_value", "huge_queries", "tiny_queries")
    assert np.isfinite(out).all() == finite


def test_R30_R32_the_planned_layer_runs_the_kernel_and_equals_forward(backend, mma):
    pb = random_problem(77, seqlens_q=(1, 1, 1, 1), Hkv=2, G=8, D=128, page_size=16, ppb=8, msb=3,
                        dtype=np.float16, used="random", hole_prob=0.1)
    be = type(backend)()  # "auto": the tensor-core kernel where it applies
    kd, vd = be.upload_kv_cache(pb.k_cache, pb.v_cache)
    plan = psa.plan_attention(pb.block_tables, pb.cu_seqlens_q, pb.used_kv_lens, block_size=pb.block_size,
                              page_size=pb.k_cache.shape[2], num_q_heads=pb.q.shape[1], num_kv_heads=2,
                              head_dim=128, kv_dtype="float16", topk=pb.selected.shape[2], causal=pb.causal,
                              softmax_scale=pb.softmax_scale, backend=be)
    assert plan._runtime.geometry["kernel"] == "decode_sgmat"
    got = plan.run(be.asarray(pb.q.astype(np.float32)), kd, vd, be.asarray(pb.selected.astype(np.int32))).numpy()
    want = psa.forward(*pb.args, **pb.options, backend=mma)
    np.testing.assert_array_equal(got, want)
    plan.close()


def test_R18_forced_on_what_it_cannot_run_raises_naming_why(backend, mma):
    f32 = random_problem(3, seqlens_q=(1, 1), Hkv=1, G=8, D=16, page_size=16, ppb=1, msb=3, used="full")
    with pytest.raises(UnsupportedError, match="tensor-core decode.*not float16.*R18"):
        psa.forward(*f32.args, **f32.options, backend=mma)
    pf = random_problem(3, seqlens_q=(2, 1), Hkv=1, G=8, D=16, page_size=16, ppb=1, msb=3, used="full",
                        dtype=np.float16)
    with pytest.raises(UnsupportedError, match="tensor-core decode.*one query.*R18"):
        psa.forward(*pf.args, **pf.options, backend=mma)
