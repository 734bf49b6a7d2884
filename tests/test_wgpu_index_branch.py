"""The index branch (R21-R25) on the wgpu backend: WGSL block scores and top-k.

Selections must be bit-for-bit those of the numpy backend for the same scores (ties, NaN,
infinities and signed zeros included, R24); block scores agree with the float64 loop reference
within the float32 dot-product bound of R22 (derived from the data and d_idx, as in
``test_index_branch.py``), with exactly the same ``-inf`` and NaN pattern. Like the other wgpu
tests these need the backend (lavapipe in CI): a missing driver fails, it does not skip. Devices
use WebGPU's default limits; shapes are small.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged_sparse_attn as psa
from paged_sparse_attn.index_branch import (
    block_scores,
    block_scores_reference,
    select_topk,
    sparse_attention,
)

from test_index_branch import (
    SPECIAL,
    _cells_below,
    _poison,
    assert_scores_close,
    attn_args,
    brute_topk,
    layouts,
    local_of,
    make_case,
    score_args,
    score_bound,
    topk_cases,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="session")
def be(WgpuBackend):
    return WgpuBackend(required_limits="default")


@pytest.fixture(scope="session")
def be_split(WgpuBackend):
    """256-byte bindings (index caches in many chunks, queries in many batches, work items in many
    plan buffers) and 2 x 2 workgroups per dispatch (the >65535-workgroup path)."""
    return WgpuBackend(required_limits="default", max_binding_size=256, max_workgroups_per_dim=2)


@pytest.fixture(scope="session")
def be_small_wg(WgpuBackend):
    """4 KiB of workgroup memory: top-k ranks at most 256 chosen blocks in workgroup memory, more
    by scanning the row; block-score tiles shrink. 3 x 3 workgroups per dispatch."""
    return WgpuBackend(required_limits={"max_compute_workgroup_storage_size": 4096}, max_workgroups_per_dim=3)


def _scores(c, backend, causal=True, **kw):
    return block_scores(*score_args(c), block_size=c["block_size"], causal=causal, backend=backend, **kw)


# --------------------------------------------------------------------------------------------
# R22: block scores
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(layout=layouts, causal=st.booleans(), dtype=st.sampled_from([np.float32, np.float16]))
def test_R22_wgpu_block_scores_match_loop_reference(be, layout, causal, dtype):
    c = make_case(**layout, dtype=dtype)
    got = _scores(c, be, causal)
    ref = block_scores_reference(*score_args(c), block_size=c["block_size"], causal=causal)
    assert got.shape == (c["index_q"].shape[0], layout["Hkv"], layout["msb"])
    assert_scores_close(got, ref, score_bound(c, causal))


def test_R22_wgpu_hand_computed_scores(be):
    # the worked example of the spec: S = BS = 2, page 1 unmapped, L = 5, queries at 3 and 4
    iq = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32)
    ik = np.zeros((3, 1, 2, 2), np.float32)
    ik[0, 0] = [[1, 2], [3, 4]]
    ik[1, 0] = np.nan  # never mapped: must not leak
    ik[2, 0] = [[5, -6], [np.inf, 8]]  # position 5 >= L_b: its Inf must not leak
    args = (iq, ik, np.array([[0, -1, 2]]), np.array([0, 2]), np.array([5]))
    got = block_scores(*args, block_size=2, softmax_scale=1.0, backend=be)
    np.testing.assert_array_equal(got, np.array([[[3, -np.inf, -np.inf]], [[4, -np.inf, -6]]], np.float32))
    got = block_scores(*args, block_size=2, softmax_scale=1.0, causal=False, backend=be)
    np.testing.assert_array_equal(got[0], [[3, -np.inf, 5]])


@settings(max_examples=25, deadline=None)
@given(layout=layouts, causal=st.booleans())
def test_R22_R10_wgpu_unmapped_and_out_of_range_memory_never_read(be, layout, causal):
    c = make_case(**layout)
    clean = _scores(c, be, causal)
    keep = _cells_below(c, c["used_kv_lens"])  # everything a query could ever see
    c2 = dict(c, index_k_cache=_poison(c, np.random.default_rng(layout["seed"]), keep=keep))
    np.testing.assert_array_equal(_scores(c2, be, causal), clean)  # same device, same bits (R19)


def test_R22_wgpu_future_position_never_read_and_visible_nan_propagates(be):
    c = make_case(11, B=1, S=2, ppb=2, msb=4, T=[5], lens=[14], holes=0.0, extra_cols=0)
    BS, bt = c["block_size"], c["block_tables"]
    clean = _scores(c, be)
    p = 10  # in the future of query 0 (position 9), seen by the others
    ik = c["index_k_cache"].copy()
    ik[bt[0, p // 2], :, p % 2] = np.nan
    got = _scores(dict(c, index_k_cache=ik), be)
    np.testing.assert_array_equal(got[0], clean[0])
    assert np.isnan(got[1:, :, p // BS]).all()  # a visible NaN logit makes the score NaN (R22)
    others = [s for s in range(4) if s != p // BS]
    np.testing.assert_array_equal(got[1:][:, :, others], clean[1:][:, :, others])


def test_R22_wgpu_visible_infinities_give_infinite_scores(be):
    c = make_case(4, B=1, S=2, ppb=1, msb=3, T=[1], lens=[6], holes=0.0, extra_cols=0, d=2, Hkv=1)
    bt = c["block_tables"]
    iq = np.array([[[1.0, 0.0]]], np.float32)
    ik = np.ones_like(c["index_k_cache"])
    ik[bt[0, 0], 0, 1] = [np.inf, 0.0]  # block 0: +inf wins its max
    ik[bt[0, 1]] = [[-np.inf, 0.0]]  # block 1: every logit -inf -> -inf
    got = block_scores(iq, ik, *score_args(c)[2:], block_size=2, backend=be)
    want = block_scores(iq, ik, *score_args(c)[2:], block_size=2, backend="numpy")
    np.testing.assert_array_equal(got, want)
    assert got[0, 0, 0] == np.inf and got[0, 0, 1] == -np.inf and np.isfinite(got[0, 0, 2])


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_R22_wgpu_chunked_cache_batches_and_split_grids_give_the_same_bits(be, be_split, shared, causal):
    c = make_case(17, B=3, S=2, ppb=2, msb=5, Hkv=2, shared=shared, d=9, T=[4, 0, 6], lens=[20, 3, 17])
    ref = _scores(c, be, causal)
    got = _scores(c, be_split, causal)
    np.testing.assert_array_equal(got, ref)  # a max is exact: chunking and batching change no bit
    dev = be_split.upload_index_cache(c["index_k_cache"])
    try:
        assert dev.layout.n_chunks > 1  # the split path is really taken
        got_dev = block_scores(c["index_q"], dev, *score_args(c)[2:], block_size=c["block_size"], causal=causal,
                               backend=be_split)
    finally:
        dev.release()
    np.testing.assert_array_equal(got_dev, ref)
    assert_scores_close(ref, block_scores_reference(*score_args(c), block_size=c["block_size"], causal=causal),
                        score_bound(c, causal))


def test_R22_wgpu_small_workgroup_memory_and_wide_index_rows(be, be_small_wg):
    # d_idx = 60: 15 vec4s per row, two register chunks per row; 4 KiB of workgroup memory
    c = make_case(23, B=2, S=4, ppb=2, msb=4, Hkv=3, d=60, T=[3, 2])
    ref = block_scores_reference(*score_args(c), block_size=c["block_size"])
    a, b = _scores(c, be), _scores(c, be_small_wg)
    assert_scores_close(a, ref, score_bound(c, True))
    assert_scores_close(b, ref, score_bound(c, True))


def test_R22_wgpu_resident_index_cache_and_page_updates(be):
    c = make_case(29, B=2, msb=4, T=[2, 3], holes=0.0)
    dev = be.upload_index_cache(c["index_k_cache"])
    try:
        np.testing.assert_array_equal(dev.to_numpy(), c["index_k_cache"])
        args = (c["index_q"], dev, *score_args(c)[2:])
        np.testing.assert_array_equal(block_scores(*args, block_size=c["block_size"], backend=be), _scores(c, be))
        ik = c["index_k_cache"].copy()
        pages = np.unique(c["block_tables"][c["block_tables"] >= 0])[:3]
        ik[pages] = -ik[pages]
        dev.write_pages(pages, ik[pages])
        np.testing.assert_array_equal(block_scores(*args, block_size=c["block_size"], backend=be),
                                      _scores(dict(c, index_k_cache=ik), be))
        with pytest.raises(psa.UnsupportedError, match="device array"):
            block_scores(*args, block_size=c["block_size"], backend="numpy")
    finally:
        dev.release()


def test_R18_wgpu_float16_index_cache_needs_shader_f16(WgpuBackend):
    nof16 = WgpuBackend(required_limits="default", disable_features=("shader-f16",))
    c = make_case(3, dtype=np.float16)
    with pytest.raises(psa.UnsupportedError, match="float16"):
        _scores(c, nof16)


# --------------------------------------------------------------------------------------------
# R24: top-k
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(case=topk_cases(), force_local=st.booleans())
def test_R24_wgpu_select_topk_bit_identical_to_numpy(be, case, force_local):
    kw = dict(force_local=force_local, cu_seqlens_q=case["cu"], used_kv_lens=case["lens"],
              block_size=case["block_size"])
    got = select_topk(case["scores"], case["topk"], **kw, backend=be)
    want = select_topk(case["scores"], case["topk"], **kw, backend="numpy")
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    c = dict(cu_seqlens_q=case["cu"], used_kv_lens=case["lens"], block_size=case["block_size"])
    local = local_of(c) if force_local else [None] * case["scores"].shape[0]
    np.testing.assert_array_equal(got, brute_topk(case["scores"], case["topk"], local))


@pytest.fixture(params=["count", "count-bounded", "radix"])
def rank_path(request, monkeypatch):
    """Every way psa_select_topk.wgsl ranks a row: by counting over the row (rows of <=
    TOPK_RANK_MAX scores in a dispatch of few rows, the default for them), by counting within the
    list of candidates above a bound (BOUND = 1, the default from TOPK_BOUND_MIN_ROWS rows on:
    forced here for every dispatch) and by radix passes (forced here for every row)."""
    from paged_sparse_attn.backends.wgpu import _index_branch

    if request.param == "radix":
        monkeypatch.setattr(_index_branch, "TOPK_RANK_MAX", 0)
    if request.param == "count-bounded":
        monkeypatch.setattr(_index_branch, "TOPK_BOUND_MIN_ROWS", 0)
    return request.param


@pytest.mark.parametrize("msb", [1, 3, 256, 257, 700])
def test_R24_wgpu_long_rows_with_ties_all_selection_paths(be, be_small_wg, msb, rank_path):
    # 256 < msb: two radix passes over the id part; topk > 256 on be_small_wg: rank by row scan;
    # rows of <= 512 scores (<= 256 on be_small_wg) ranked by counting unless rank_path forces radix
    rng = np.random.default_rng(msb)
    special = np.array(SPECIAL + [1e-30, -1e-30, 3e38, -3e38], np.float32)
    scores = np.where(rng.random((3, 2, msb)) < 0.5, rng.choice(special, (3, 2, msb)),
                      rng.integers(-3, 4, (3, 2, msb))).astype(np.float32)
    cu, lens = np.array([0, 2, 3]), np.array([2 * msb, max(0, 2 * msb - 3)])
    for k in sorted({1, 2, 5, msb // 2 + 1, msb - 1, msb, msb + 3} - {0}):
        for fl in (False, True):
            kw = dict(cu_seqlens_q=cu, used_kv_lens=lens, block_size=2) if fl else {}
            want = select_topk(scores, k, force_local=fl, backend="numpy", **kw)
            for b in (be, be_small_wg):
                np.testing.assert_array_equal(select_topk(scores, k, force_local=fl, backend=b, **kw), want,
                                              err_msg=f"msb={msb} topk={k} force_local={fl} {b!r}")


def test_R24_wgpu_spec_example_and_forced_local_with_nan(be):
    scores = np.array([[[0.0, np.nan, 1.0, -0.0, 1.0, -np.inf, np.inf]]], np.float32)
    np.testing.assert_array_equal(select_topk(scores, 9, force_local=False, backend=be)[0, 0],
                                  [6, 2, 4, 0, 3, -1, -1, -1, -1])
    np.testing.assert_array_equal(select_topk(-scores, 2, force_local=False, backend=be)[0, 0], [5, 0])
    local = dict(cu_seqlens_q=np.array([0, 1]), used_kv_lens=np.array([4]), block_size=2)
    np.testing.assert_array_equal(select_topk(scores, 3, **local, backend=be)[0, 0], [1, 6, 2])
    sc2 = np.array([[[5.0, np.nan, 4.0]], [[5.0, 4.0, -np.inf]]], np.float32)
    two = dict(cu_seqlens_q=np.array([0, 2]), used_kv_lens=np.array([6]), block_size=2)
    np.testing.assert_array_equal(select_topk(sc2, 2, **two, backend=be)[:, 0], [[2, 0], [2, 0]])
    np.testing.assert_array_equal(select_topk(sc2, 1, **two, backend=be)[:, 0], [[2], [2]])


def test_R24_wgpu_topk_zero_empty_rows_and_split_grids(be, be_split):
    assert select_topk(np.ones((2, 1, 3), np.float32), 0, force_local=False, backend=be).shape == (2, 1, 0)
    assert select_topk(np.ones((0, 2, 3), np.float32), 2, force_local=False, backend=be).shape == (0, 2, 2)
    rng = np.random.default_rng(5)
    scores = rng.choice(np.array(SPECIAL, np.float32), size=(9, 3, 12))  # 27 rows: 7 dispatches of 2 x 2
    for k in (1, 4, 13):
        want = select_topk(scores, k, force_local=False, backend="numpy")
        np.testing.assert_array_equal(select_topk(scores, k, force_local=False, backend=be_split), want)


# --------------------------------------------------------------------------------------------
# R25 and R19: end to end
# --------------------------------------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(layout=layouts, causal=st.booleans(), extra=st.integers(0, 2))
def test_R25_wgpu_topk_covering_all_blocks_equals_dense(be, layout, causal, extra):
    c = make_case(**layout)
    Tq, Hkv = c["index_q"].shape[:2]
    msb = layout["msb"]
    common = dict(used_kv_lens=c["used_kv_lens"], block_size=c["block_size"])
    out, lse = sparse_attention(*attn_args(c), **common, topk=msb + extra, causal=causal, return_lse=True,
                                backend=be)
    everything = np.broadcast_to(np.arange(msb), (Tq, Hkv, msb)).copy()
    ref, ref_lse = psa.dense_reference(c["q"], c["k_cache"], c["v_cache"], c["block_tables"], everything,
                                       c["cu_seqlens_q"], **common, causal=causal)
    tol = 64 * F32_EPS  # float32 against the float64 oracle (R20), as in test_index_branch
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


@pytest.mark.parametrize("causal", [True, False])
def test_R25_R19_wgpu_sparse_attention_is_its_three_steps_and_deterministic(be, causal):
    c = make_case(31, B=3, msb=5, T=[3, 1, 2], Hkv=2, G=2)
    common = dict(used_kv_lens=c["used_kv_lens"], block_size=c["block_size"], causal=causal)
    out, lse = sparse_attention(*attn_args(c), **common, topk=2, return_lse=True, backend=be)
    scores = _scores(c, be, causal)
    sel = select_topk(scores, 2, cu_seqlens_q=c["cu_seqlens_q"], used_kv_lens=c["used_kv_lens"],
                      block_size=c["block_size"], backend=be)
    fwd = psa.forward(c["q"], c["k_cache"], c["v_cache"], c["block_tables"], sel, c["cu_seqlens_q"], **common,
                      backend=be, return_lse=True)
    np.testing.assert_array_equal(out, fwd[0])
    np.testing.assert_array_equal(lse, fwd[1])
    again = sparse_attention(*attn_args(c), **common, topk=2, return_lse=True, backend=be)
    np.testing.assert_array_equal(again[0], out)
    np.testing.assert_array_equal(again[1], lse)
    np.testing.assert_array_equal(_scores(c, be, causal), scores)


@pytest.mark.parametrize("seed", range(6))
def test_R22_wgpu_decode_block_scores_match_loop_reference(be, seed):
    """One query per sequence (items of at most 8 rows: ``psa_block_scores_decode.wgsl``), shared
    or per-head index keys, both dtypes, causal or not: scores equal the loop reference within the
    dot-product bound and ``-inf`` exactly where nothing is visible."""
    rng = np.random.default_rng(seed)
    B, Hkv = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    c = make_case(seed, B=B, Hkv=Hkv, msb=int(rng.integers(1, 5)), T=rng.integers(0, 2, size=B),
                  d=int(rng.choice([4, 8, 12])), shared=bool(seed % 2), ppb=int(rng.choice([1, 2, 3])),
                  dtype=np.float16 if seed % 3 == 0 else np.float32)
    for causal in (True, False):
        got = _scores(c, be, causal)
        ref = block_scores_reference(*score_args(c), block_size=c["block_size"], causal=causal)
        assert_scores_close(got, ref, score_bound(c, causal))


def _decode_score_kernels(backend) -> set:
    """Decode block-score kernels the backend has built pipelines of."""
    return {k[0] for k in backend._device().pipelines if str(k[0]).startswith("psa_block_scores_decode")}


@pytest.mark.parametrize("seed", range(8))
def test_R22_wgpu_decode_scores_key_groups_equal_rows_kernel(WgpuBackend, seed, monkeypatch):
    """Decode items read by key groups of one subgroup (``psa_block_scores_decode_sg.wgsl``) give
    the loop reference within the bound of R22, -inf and NaN exactly where it has them, the same
    on a second run (R19), and never read what nothing may see (poisoned memory changes no bit);
    the one-row-per-invocation kernel it replaces gives results within the same bound."""
    from paged_sparse_attn.backends.wgpu import _index_branch

    # both load schedules (the next chunk's loads in flight or not), workgroups of 1-4 subgroups
    monkeypatch.setattr(_index_branch, "SCORES_DECODE_SG_PF", seed % 2)
    monkeypatch.setattr(_index_branch, "SCORES_DECODE_SG_WG", (32, 64, 128)[seed % 3])
    rng = np.random.default_rng(100 + seed)
    groups = WgpuBackend(required_limits="default")
    rows = WgpuBackend(required_limits="default")
    rows._decode_scores_sg = False
    size = groups._device().subgroup[0]
    if size is None:
        pytest.fail(f"the wgpu device measured no subgroup size: {groups._device().subgroup[1]}")
    dtype = np.float16 if seed % 2 else np.float32
    # index rows of 1 .. `size` 16-byte units (the widest a group of one subgroup reads)
    units = int(rng.integers(1, size + 1))
    d = units * 16 // np.dtype(dtype).itemsize - int(rng.integers(0, 4 if dtype == np.float32 else 1))
    B, Hkv = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    T = rng.integers(0, 2, size=B)
    T[0] = 1  # at least one query
    S, ppb, msb = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 3])), int(rng.integers(1, 5))
    lens = rng.integers(0, msb * S * ppb + 1, size=B)
    lens[0] = max(1, lens[0])
    c = make_case(200 + seed, B=B, Hkv=Hkv, msb=msb, T=T, lens=lens, d=d, shared=bool(seed % 3), S=S, ppb=ppb,
                  holes=0.0 if seed < 4 else 0.3, dtype=dtype)
    for causal in (True, False):
        got = _scores(c, groups, causal)
        if seed < 4:  # (no holes: something is readable, the kernel ran)
            assert _decode_score_kernels(groups) == {"psa_block_scores_decode_sg.wgsl"}
        ref = block_scores_reference(*score_args(c), block_size=c["block_size"], causal=causal)
        assert_scores_close(got, ref, score_bound(c, causal))
        np.testing.assert_array_equal(_scores(c, groups, causal), got)
        assert_scores_close(_scores(c, rows, causal), ref, score_bound(c, causal))
        keep = _cells_below(c, c["used_kv_lens"])
        poisoned = dict(c, index_k_cache=_poison(c, rng, keep=keep))
        np.testing.assert_array_equal(_scores(poisoned, groups, causal), got)
    assert _decode_score_kernels(rows) <= {"psa_block_scores_decode.wgsl"}
    assert _decode_score_kernels(groups) <= {"psa_block_scores_decode_sg.wgsl"}


def _joint_reduction_ran(backend) -> bool:
    """Whether the decode key-group kernel was built with the joint reduction (JR = 1)."""
    return any(k[0] == "psa_block_scores_decode_sg.wgsl" and dict(k[4]).get("JR") == 1
               for k in backend._device().pipelines)


@pytest.mark.parametrize("seed", range(4))
def test_R22_R19_decode_scores_joint_reduction_of_16_lane_groups(WgpuBackend, seed, monkeypatch):
    """Key groups of 16 lanes holding at most 4 rows (the MSA decode shape: float16 rows of 128
    dims, 4 KV heads) reduce a chunk's 4 positions x 4 rows together (the kernel's JR): the loop
    reference within R22's bound, NaN and infinities exactly where it has them, the same bits on a
    second run and with poisoned unread memory, and within the bound of the per-position
    reduction (JR off). Devices whose subgroups are narrower (lavapipe: 8 lanes) run this test
    again in a process where llvmpipe uses 512-bit vectors (16-lane subgroups)."""
    import os
    import subprocess
    import sys

    from paged_sparse_attn.backends.wgpu import _index_branch

    be = WgpuBackend(required_limits="default")
    size = be._device().subgroup[0]
    if size is None or size < 16:
        assert "llvmpipe" in be.device_summary, f"subgroups of {size} lanes on {be.device_summary}"
        env = {**os.environ, "LP_NATIVE_VECTOR_WIDTH": "512"}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"{__file__}::test_R22_R19_decode_scores_joint_reduction_of_16_lane_groups[{seed}]"],
                             env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
        return
    rng = np.random.default_rng(300 + seed)
    B, Hkv = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    d = int(rng.choice([72, 128]))  # 9 and 16 units of 8 float16: groups of 16 lanes
    lens = rng.integers(1, 4 * 8 * 2 + 1, size=B)
    c = make_case(400 + seed, B=B, Hkv=Hkv, msb=4, T=[1] * B, lens=lens, d=d, S=8, ppb=2, shared=bool(seed % 2),
                  holes=0.0 if seed < 2 else 0.3, dtype=np.float16)
    if seed == 3:  # NaN and infinite keys at visible positions
        ik = c["index_k_cache"].copy()
        ik[c["block_tables"][0, 0], 0, 1, 3] = np.nan
        ik[c["block_tables"][0, 1], :, 2, :] = -np.inf
        c = dict(c, index_k_cache=ik)
    off = WgpuBackend(required_limits="default")
    for causal in (True, False):
        got = _scores(c, be, causal)
        ref = block_scores_reference(*score_args(c), block_size=c["block_size"], causal=causal)
        bound = score_bound(c, causal)
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        assert np.array_equal(np.isposinf(got), np.isposinf(ref))
        assert np.array_equal(np.isneginf(got), np.isneginf(ref))
        assert_scores_close(got, ref, bound)
        np.testing.assert_array_equal(_scores(c, be, causal), got)
        keep = _cells_below(c, c["used_kv_lens"])
        np.testing.assert_array_equal(_scores(dict(c, index_k_cache=_poison(c, rng, keep=keep)), be, causal), got)
        with monkeypatch.context() as m:
            m.setattr(_index_branch, "SCORES_DECODE_SG_JR", False)
            per_position = _scores(c, off, causal)
        assert_scores_close(per_position, ref, bound)
    assert _joint_reduction_ran(be) and not _joint_reduction_ran(off)


def test_R22_wgpu_decode_scores_key_groups_nan_inf_and_chunks(WgpuBackend, be_split):
    """Visible NaN and infinite index keys reach the decode scores exactly as in the reference; a
    cache split into many binding chunks gives the same bits."""
    be = WgpuBackend(required_limits="default")
    c = make_case(7, B=3, S=2, ppb=2, msb=4, Hkv=4, d=16, T=[1, 1, 1], lens=[15, 9, 16], holes=0.0,
                  extra_cols=0, dtype=np.float16)
    ik = c["index_k_cache"].copy()
    bt = c["block_tables"]
    ik[bt[0, 1], 0, 0, 3] = np.nan  # sequence 0, position 2: block 0 NaN
    ik[bt[1, 2], 0, 1, 5] = np.inf  # sequence 1, position 5: block 1 +-inf (sign of the query)
    ik[bt[2, 7], 0, 1, :] = -np.inf  # sequence 2, position 15
    bound = score_bound(c, False)  # of the clean keys: at least the bound of the finite scores
    c = dict(c, index_k_cache=ik)
    got = _scores(c, be, False)
    assert _decode_score_kernels(be) == {"psa_block_scores_decode_sg.wgsl"}
    want = block_scores_reference(*score_args(c), block_size=c["block_size"], causal=False)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[0, :, 0]).all()
    assert np.array_equal(np.isposinf(got), np.isposinf(want))
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    assert_scores_close(got, want, bound)
    np.testing.assert_array_equal(_scores(c, be_split, False), got)


@pytest.mark.parametrize("timestamps", [False, True])
def test_R25_wgpu_planned_decode_layer_equals_sparse_attention(WgpuBackend, timestamps):
    """A planned decode layer (block scores, top-k and attention in one submission: one compute
    pass, or a pass per stage when timed) gives the bits of sparse_attention's own path."""
    c = make_case(41, B=5, S=2, ppb=2, msb=6, Hkv=2, G=2, d=16, T=[1, 1, 0, 1, 1], lens=[24, 7, 9, 17, 1],
                  holes=0.1)
    be = WgpuBackend(required_limits="default", timestamps=timestamps)
    kd, vd = be.upload_kv_cache(c["k_cache"], c["v_cache"])
    ikd = be.upload_index_cache(c["index_k_cache"])
    plan = psa.plan_attention(c["block_tables"], c["cu_seqlens_q"], c["used_kv_lens"], block_size=c["block_size"],
                              page_size=2, num_q_heads=4, num_kv_heads=2, head_dim=8, kv_dtype=np.float32, topk=3,
                              causal=True, index_dim=16, num_index_heads=1, backend=be)
    try:
        got = plan.run_sparse(c["q"], kd, vd, c["index_q"], ikd, return_lse=True)
        again = plan.run_sparse(be.asarray(c["q"]), kd, vd, be.asarray(c["index_q"]), ikd)
        want = sparse_attention(*attn_args(c), used_kv_lens=c["used_kv_lens"], block_size=c["block_size"], topk=3,
                                return_lse=True, backend=be)
        assert _decode_score_kernels(be) == {"psa_block_scores_decode_sg.wgsl"}
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want))
        assert np.array_equal(again.numpy(), got[0], equal_nan=True)
    finally:
        plan.close()


def _decode_layer(WgpuBackend, lens, BS=4):
    """A small decode MSA layer on a wgpu device (4 sequences of one query, 5 blocks of ``BS``,
    sequence lengths ``lens``): ``(case, backend, k, v, index keys, plan)``, all resident."""
    B = len(lens)
    c = make_case(45, B=B, S=2, ppb=BS // 2, msb=5, Hkv=2, G=2, d=16, T=[1] * B, lens=lens, holes=0.0,
                  extra_cols=0)
    be = WgpuBackend(required_limits="default")
    kd, vd = be.upload_kv_cache(c["k_cache"], c["v_cache"])
    ikd = be.upload_index_cache(c["index_k_cache"])
    plan = psa.plan_attention(c["block_tables"], c["cu_seqlens_q"], c["used_kv_lens"], block_size=BS,
                              page_size=2, num_q_heads=4, num_kv_heads=2, head_dim=8, kv_dtype=np.float32, topk=2,
                              causal=True, index_dim=16, num_index_heads=1, backend=be)
    return c, be, kd, vd, ikd, plan


@pytest.mark.parametrize("full", [True, False])
def test_R25_wgpu_decode_layer_stores_each_score_once_and_keeps_no_old_scores(WgpuBackend, full):
    """A decode layer whose block-score items hold every score key once stores the keys without
    clearing the scores first (the key-group kernel's ONCE); layers with other index queries, run
    back to back on one plan with the index queries bound where they are, give the bits of
    sparse_attention for their own inputs (an old key kept would change a selection). Lengths
    that leave blocks without an item keep the clear and the merge."""
    BS = 4
    c, be, kd, vd, ikd, plan = _decode_layer(WgpuBackend, [5 * BS] * 4 if full else [5 * BS, 7, 5 * BS, 13], BS)
    rng = np.random.default_rng(3)
    iqs = [rng.standard_normal(c["index_q"].shape).astype(np.float32) * s for s in (1.0, -3.0, 0.5, 1.0)]
    iqs[3][:, :, :] = 0.0  # every score 0: ties everywhere, the lowest ids win (R24)
    try:
        outs = [plan.run_sparse(be.asarray(c["q"]), kd, vd, be.asarray(iq), ikd) for iq in iqs]
        assert _decode_score_kernels(be) == {"psa_block_scores_decode_sg.wgsl"}
        assert plan._runtime.sparse.once is full
        for iq, o in zip(iqs, outs):
            want = sparse_attention(c["q"], c["k_cache"], c["v_cache"], iq, c["index_k_cache"], c["block_tables"],
                                    c["cu_seqlens_q"], used_kv_lens=c["used_kv_lens"], block_size=BS, topk=2,
                                    backend=be)
            assert np.array_equal(o.numpy(), want, equal_nan=True)
    finally:
        plan.close()


def test_R32_wgpu_decode_layer_after_a_decode_step_binds_its_new_index_branch(WgpuBackend):
    """A decode step (``update``) rebuilds the plan's index-branch buffers; the same device
    ``index_q`` then binds to the new ones, never to bind groups of the buffers it replaced (which
    a submission refuses), and the layer equals sparse_attention for the new lengths."""
    BS = 4
    c, be, kd, vd, ikd, plan = _decode_layer(WgpuBackend, [12, 7, 15, 13], BS)
    qd, iqd = be.asarray(c["q"]), be.asarray(c["index_q"])
    try:
        for lens in (c["used_kv_lens"], c["used_kv_lens"] + 3, c["used_kv_lens"] + 5):
            lens = np.asarray(lens, np.int32)
            plan.update(used_kv_lens=lens)
            got = plan.run_sparse(qd, kd, vd, iqd, ikd).numpy()
            want = sparse_attention(c["q"], c["k_cache"], c["v_cache"], c["index_q"], c["index_k_cache"],
                                    c["block_tables"], c["cu_seqlens_q"], used_kv_lens=lens, block_size=BS, topk=2,
                                    backend=be)
            assert np.array_equal(got, want, equal_nan=True)
    finally:
        plan.close()


def test_R25_score_items_cover_each_key_once_only_when_they_do():
    """The host's proof behind the ONCE store: every (t, h, s) key of the scores exactly once."""
    from paged_sparse_attn.backends.wgpu._layer import covers_once

    # items (t0, r0, n_rows, nh, h_off, pages, npos, s): 2 queries x 2 heads (one item per query
    # and block, rows = heads) x 3 blocks
    items = np.array([[t, 0, 2, 2, 0, 0, 4, s] for t in range(2) for s in range(3)], np.int64)
    assert covers_once(items, 2, 2, 3)
    assert not covers_once(items[:-1], 2, 2, 3)  # a key without an item
    dup = items.copy()
    dup[-1, 7] = 0  # a key twice, another none
    assert not covers_once(dup, 2, 2, 3)
    half = np.concatenate([items, items])
    half[:, 2] = 1
    half[len(items):, 1] = 1  # rows split over two items each: still once
    assert covers_once(half, 2, 2, 3)
    assert not covers_once(items, 2, 2, 4)  # a block of the buffer no item holds
    assert not covers_once(np.zeros((0, 8), np.int64), 0, 2, 3)


def _decode_on_device(backend, keys: np.ndarray) -> np.ndarray:
    """``keys`` (u32) through psa_score_keys.wgsl as block_scores() runs it: float32 bits back."""
    from paged_sparse_attn.backends.wgpu._index_branch import (
        KEY_DECODE,
        KEY_DECODE_WG,
        _Run,
        key_decode_dispatches,
    )
    from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage

    ctx = backend._device()
    run = _Run(ctx, pooled=False)
    got = {}
    try:
        buf = ctx.device.create_buffer(size=max(16, keys.nbytes), label="test.keys",
                                       usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC | BufferUsage.COPY_DST)
        run.owned.append(buf)
        ctx.device.queue.write_buffer(buf, 0, keys)
        pipe, bgl = backend._ib_pipeline(KEY_DECODE, False, {"WG": KEY_DECODE_WG})
        for rec, gx, gy in key_decode_dispatches(keys.size, ctx.workgroups_per_dim):
            run.dispatch(pipe, bgl, [buf], rec, gx, gy)
        run.read(buf, keys.nbytes, lambda raw: got.setdefault("v", raw.view(np.uint32).copy()))
        run.submit()
    finally:
        run.close()
    return got["v"]


@pytest.mark.parametrize("which", ["be", "be_split"])
def test_R22_score_keys_decode_on_the_device_to_the_floats_they_encode(which, request):
    """psa_score_keys.wgsl inverts the score kernels' key encoding bit for bit: every float32 (both
    zeros, subnormals, the extremes, infinities) comes back with its bits, 0 (nothing visible) as
    -inf and 0xffffffff as the quiet NaN; a sweep of the whole key range decodes to floats whose
    re-encoding is the key (NaN and 0 aside). ``be_split`` spreads the words over many dispatches
    of 2 x 2 workgroups (each dispatch's first workgroup and count, the words past the last)."""
    backend = request.getfixturevalue(which)

    def encode(x):
        b = np.asarray(x, np.float32).view(np.uint32)
        return np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)

    rng = np.random.default_rng(5)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1.17549435e-38, -1.17549435e-38,
                        3.4028235e38, -3.4028235e38, 1.0, -1.0], np.float32)
    n_rand = 10_000 if which == "be" else 3_000  # 4 workgroups of 256 words per dispatch: 3 dispatches
    x = np.concatenate([special, rng.standard_normal(n_rand).astype(np.float32) * np.float32(1e3)])
    bits = _decode_on_device(backend, encode(x))
    np.testing.assert_array_equal(bits, x.view(np.uint32))
    if which == "be":
        keys = np.arange(1, 2**32 - 1, 65521, dtype=np.uint64).astype(np.uint32)
        dec = _decode_on_device(backend, keys).view(np.float32)
        finite = ~np.isnan(dec)
        assert finite.sum() > 0.99 * keys.size  # only the NaN floats' keys decode to NaN
        np.testing.assert_array_equal(encode(dec[finite]), keys[finite])
    edge = _decode_on_device(backend, np.array([0, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 5], np.uint32))
    assert edge.tolist()[:4] == [0xFF800000, 0x7FC00000, 0x00000000, 0x80000000]
    assert edge[4] == ~np.uint32(5)


@pytest.mark.parametrize("seed", range(4))
def test_R22_R24_wgpu_index_kernels_give_the_same_bits_without_runtime_checks(WgpuBackend, seed):
    """The index-branch kernels are compiled without naga's runtime checks (trusted, like the
    attention kernels: every index comes from validated arrays and the host's plan); block scores
    and selections have the same bits as with the checks, on decode and multi-query items, both
    dtypes, NaN / inf in cells nothing may see included (a clamped out-of-range access, or a
    read of one, would change them)."""
    on = WgpuBackend(required_limits="default", runtime_checks=True)
    off = WgpuBackend(required_limits="default")
    rng = np.random.default_rng(300 + seed)
    B = int(rng.integers(1, 4))
    T = rng.integers(0, 2, size=B) if seed % 2 else rng.integers(1, 6, size=B)
    T[0] = max(int(T[0]), 1)  # at least one query: kernels run
    c = make_case(300 + seed, B=B, Hkv=int(rng.integers(1, 5)), msb=int(rng.integers(2, 6)), T=T,
                  d=int(rng.choice([4, 8, 16])), shared=bool(seed % 3), dtype=(np.float16, np.float32)[seed % 2])
    c["index_k_cache"] = _poison(c, rng, keep=_cells_below(c, c["used_kv_lens"]))  # NaN / inf where no query sees
    tk = dict(cu_seqlens_q=c["cu_seqlens_q"], used_kv_lens=c["used_kv_lens"], block_size=c["block_size"])
    for causal in (True, False):
        a, b = _scores(c, on, causal), _scores(c, off, causal)
        assert a.tobytes() == b.tobytes()
        k = min(2, a.shape[2])
        sa = select_topk(a, k, force_local=causal, backend=on, **tk)
        sb = select_topk(a, k, force_local=causal, backend=off, **tk)
        assert np.array_equal(sa, sb)
    # the kernels did run with and without the checks (pipeline keys: kernel, entry, f16, checks, ...)
    built = {(k[0], k[3]) for be in (on, off) for k in be._device().pipelines}
    names = {k for k, _ in built if "block_scores" in k or "select_topk" in k}
    assert names and all((n, True) in built and (n, False) in built for n in names)


@pytest.mark.parametrize("msb, entry", [(1, "rank_rows"), (255, "rank_rows"), (256, "rank_rows"), (257, "main"),
                                        (4096, "main")])
def test_R24_topk_entry_point_by_row_length(msb, entry):
    """Rows of at most RANK_MAX scores take `rank_rows` (counting, CAP = RANK_MAX), longer rows the
    radix select of `main` (CAP from the device's workgroup memory)."""
    from types import SimpleNamespace

    from paged_sparse_attn.backends.wgpu._index_branch import (
        TOPK_RANK_MAX,
        TOPK_WG,
        topk_cap,
        topk_pipeline_args,
    )

    ctx = SimpleNamespace(workgroup_storage=32768)
    got, consts = topk_pipeline_args(ctx, True, msb, 16384)
    assert got == entry and consts["WG"] == TOPK_WG and consts["KEYS"] == 1
    assert consts["CAP"] == (min(TOPK_RANK_MAX, 4 * TOPK_WG) if entry == "rank_rows" else topk_cap(ctx))
    assert "KEYS" not in topk_pipeline_args(ctx, False, msb, 16384)[1]


@pytest.mark.parametrize("rows", [1, 128, 1023, 1024, 16384])
def test_R24_topk_bounded_list_from_many_rows(rows):
    """BOUND (short rows ranked within the list of candidates above a bound) where a dispatch
    has TOPK_BOUND_MIN_ROWS rows or more (prefill: 16384 rows), not where the rows are one
    wave of workgroups (decode: 128), on both entry points."""
    from types import SimpleNamespace

    from paged_sparse_attn.backends.wgpu._index_branch import (
        TOPK_BOUND_MIN_ROWS,
        topk_pipeline_args,
    )

    assert 128 < TOPK_BOUND_MIN_ROWS <= 16384
    for msb in (256, 4096):
        _, consts = topk_pipeline_args(SimpleNamespace(workgroup_storage=32768), True, msb, rows)
        assert consts["BOUND"] == int(rows >= TOPK_BOUND_MIN_ROWS)


def test_R24_topk_rank_rows_needs_a_quarter_of_mains_workgroup_memory(tint_device):
    """What `rank_rows` is for: Tint counts its workgroup memory without the radix select's
    histograms and with CAP = RANK_MAX (the Null adapter refuses more than 16 KiB and says how
    much a pipeline asked for)."""
    import re
    from types import SimpleNamespace

    from paged_sparse_attn.backends.wgpu._index_branch import TOPK, topk_pipeline_args
    from paged_sparse_attn.backends.wgpu._kernels import kernel_source

    device, ctx = tint_device
    module = device.create_shader_module(code=kernel_source(ctx, TOPK))
    used = {}
    for msb in (256, 4096):
        entry, consts = topk_pipeline_args(SimpleNamespace(workgroup_storage=49152), True, msb, 16384)
        consts = {**consts, "CAP": consts["CAP"] + 2000}  # over the Null adapter's limit by a known amount
        with pytest.raises(Exception) as err:
            device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry,
                                                                   "constants": consts})
        used[entry] = int(re.search(r"workgroup storage \((\d+) bytes\)", str(err.value)).group(1)) - 16000
    assert used["rank_rows"] <= 2640 and used["main"] >= 9500, used
