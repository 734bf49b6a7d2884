"""The index branch (R21-R25): block scores, exp-free top-k with the local block, sparse_attention.

Oracles are independent of the vectorised code: block scores against a float64 loop over visible
positions, top-k against Python's ``sorted`` with the key ``(-score, id)`` written out below, and
sparse_attention against ``dense_reference`` with the same selection.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged_sparse_attn as psa
from paged_sparse_attn.backends.numpy_backend import NumpyBackend
from paged_sparse_attn.index_branch import (
    block_scores,
    block_scores_reference,
    select_topk,
    select_topk_reference,
    sparse_attention,
)
from paged_sparse_attn.backends import numpy_index as numpy_impl

F32_EPS = float(np.finfo(np.float32).eps)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------
# problem builders
# --------------------------------------------------------------------------------------------

def make_case(seed, *, B=2, S=2, ppb=2, msb=3, Hkv=2, shared=True, d=8, G=2, D=8, T=None, lens=None,
              holes=0.2, spare=2, extra_cols=1, dtype=np.float32):
    """Paged caches with scrambled pages, holes, spare pages and columns past msb*ppb.

    Returns a dict of the sparse_attention arguments (``block_scores`` takes a subset).
    """
    rng = np.random.default_rng(seed)
    BS = S * ppb
    cols = msb * ppb + extra_cols % ppb  # a partial block past msb*ppb is never read (R5)
    P = B * cols + spare
    perm = rng.permutation(P)[: B * cols].reshape(B, cols)
    bt = np.where(rng.random((B, cols)) < holes, -1, perm)
    if T is None:
        T = rng.integers(0, 4, size=B)
    if lens is None:
        lens = rng.integers(0, msb * BS + 1, size=B)
    cu = np.concatenate([[0], np.cumsum(T)])
    Tq = int(cu[-1])
    Hk = 1 if shared else Hkv
    return dict(
        q=rng.standard_normal((Tq, Hkv * G, D)).astype(dtype),
        k_cache=rng.standard_normal((P, Hkv, S, D)).astype(dtype),
        v_cache=rng.standard_normal((P, Hkv, S, D)).astype(dtype),
        index_q=rng.standard_normal((Tq, Hkv, d)).astype(dtype),
        index_k_cache=rng.standard_normal((P, Hk, S, d)).astype(dtype),
        block_tables=bt, cu_seqlens_q=cu, used_kv_lens=np.asarray(lens), block_size=BS,
    )


def score_args(c):
    return (c["index_q"], c["index_k_cache"], c["block_tables"], c["cu_seqlens_q"], c["used_kv_lens"])


def attn_args(c):
    return (c["q"], c["k_cache"], c["v_cache"], c["index_q"], c["index_k_cache"], c["block_tables"],
            c["cu_seqlens_q"])


def query_pos(c):
    """Per query: (sequence b, own position L_b - T_b + i), in plain Python."""
    cu, lens = [int(x) for x in c["cu_seqlens_q"]], [int(x) for x in c["used_kv_lens"]]
    out = []
    for b in range(len(cu) - 1):
        T = cu[b + 1] - cu[b]
        out += [(b, lens[b] - T + i) for i in range(T)]
    return out


def score_bound(c, causal, scale=None):
    """Error bound of a float32 evaluation of every block score: (d + 2) eps * max |q| . |k| (R20)."""
    d = c["index_q"].shape[2]
    mag = block_scores_reference(np.abs(c["index_q"]), np.abs(c["index_k_cache"]), *score_args(c)[2:],
                                 block_size=c["block_size"], causal=causal, softmax_scale=scale)
    return (d + 2) * F32_EPS * np.abs(np.where(np.isfinite(mag), mag, 0)) + np.finfo(np.float32).tiny


def assert_scores_close(got, ref, bound):
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))  # -inf exactly where nothing is visible
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    fin = np.isfinite(ref)
    err = np.abs(got[fin].astype(np.float64) - ref[fin])
    assert (err <= bound[fin]).all(), f"max error {err.max()} vs bound {bound[fin][np.argmax(err - bound[fin])]}"


def brute_topk(scores, topk, local):
    """Python ``sorted`` with key (-score, id); the local block (if any) first. Independent oracle."""
    Tq, Hkv, msb = scores.shape
    out = np.full((Tq, Hkv, topk), -1, dtype=np.int64)
    for t in range(Tq):
        for h in range(Hkv):
            row = [float(v) for v in scores[t, h]]
            rest = sorted((s for s in range(msb) if s != local[t] and not math.isnan(row[s]) and row[s] != -math.inf),
                          key=lambda s: (-row[s], s))
            chosen = ([local[t]] if local[t] is not None else []) + rest
            chosen = chosen[:topk]
            out[t, h, :len(chosen)] = chosen
    return out


def local_of(c):
    BS = c["block_size"]
    return [pos // BS if pos >= 0 else None for _, pos in query_pos(c)]


layouts = st.fixed_dictionaries(dict(
    seed=st.integers(0, 2**32 - 1), B=st.integers(1, 3), S=st.sampled_from([1, 2, 4]),
    ppb=st.integers(1, 2), msb=st.integers(1, 5), Hkv=st.integers(1, 3), shared=st.booleans(),
    d=st.integers(1, 9), holes=st.sampled_from([0.0, 0.3]), extra_cols=st.integers(0, 1),
))


# --------------------------------------------------------------------------------------------
# R22: block scores
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(layout=layouts, causal=st.booleans(), dtype=st.sampled_from([np.float32, np.float16]))
def test_R22_block_scores_match_loop_reference(layout, causal, dtype):
    c = make_case(**layout, dtype=dtype)
    got = block_scores(*score_args(c), block_size=c["block_size"], causal=causal)
    ref = block_scores_reference(*score_args(c), block_size=c["block_size"], causal=causal)
    assert got.shape == (c["index_q"].shape[0], layout["Hkv"], layout["msb"])
    assert_scores_close(got, ref, score_bound(c, causal))


def test_R22_default_scale_is_one_over_sqrt_d_idx():
    c = make_case(3, d=9)
    bs = c["block_size"]
    default = block_scores(*score_args(c), block_size=bs)
    explicit = block_scores(*score_args(c), block_size=bs, softmax_scale=1 / 3)
    np.testing.assert_array_equal(default, explicit)
    doubled = block_scores(*score_args(c), block_size=bs, softmax_scale=2 / 3)
    fin = np.isfinite(default)
    assert fin.any()
    np.testing.assert_allclose(doubled[fin], 2 * default[fin], rtol=4 * F32_EPS)


def test_R22_hand_computed_scores():
    # one sequence, S=2, BS=2, 3 blocks; L=5 so block 2 holds position 4 only; page 1 unmapped
    iq = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32)  # T=2 queries at positions 3 and 4
    ik = np.zeros((3, 1, 2, 2), np.float32)
    ik[0, 0] = [[1, 2], [3, 4]]  # positions 0, 1
    ik[1, 0] = [[9, 9], [9, 9]]  # maps nothing (block_tables never points at it)
    ik[2, 0] = [[5, -6], [7, 8]]  # positions 4, 5 (5 >= L)
    bt = np.array([[0, -1, 2]])
    got = block_scores(iq, ik, bt, np.array([0, 2]), np.array([5]), block_size=2, softmax_scale=1.0)
    want = np.array([[[3, -np.inf, -np.inf]],  # query at 3: block 2 (position 4) is in its future
                     [[4, -np.inf, -6]]], np.float32)  # query at 4 sees position 4: -6
    np.testing.assert_array_equal(got, want)
    no_causal = block_scores(iq, ik, bt, np.array([0, 2]), np.array([5]), block_size=2, softmax_scale=1.0,
                             causal=False)
    np.testing.assert_array_equal(no_causal[0], [[3, -np.inf, 5]])


def _poison(c, rng, *, keep):
    """Fill every index-key cell not in ``keep`` (a set of (page, slot)) with NaN / +-Inf."""
    ik = c["index_k_cache"].copy()
    vals = np.array([np.nan, np.inf, -np.inf], dtype=ik.dtype)
    for pg in range(ik.shape[0]):
        for sl in range(ik.shape[2]):
            if (pg, sl) not in keep:
                ik[pg, :, sl] = rng.choice(vals, size=ik[pg, :, sl].shape)
    return ik


def _cells_below(c, ends):
    """(page, slot) cells of mapped positions < ends[b] of every sequence b."""
    S, bt = c["k_cache"].shape[2], c["block_tables"]
    msb_pos = (bt.shape[1] // (c["block_size"] // S)) * c["block_size"]
    keep = set()
    for b, end in enumerate(ends):
        for p in range(min(int(end), msb_pos)):
            if bt[b, p // S] >= 0:
                keep.add((int(bt[b, p // S]), p % S))
    return keep


@settings(max_examples=60, deadline=None)
@given(layout=layouts, causal=st.booleans())
def test_R22_R10_unmapped_and_out_of_range_memory_never_read(layout, causal):
    c = make_case(**layout)
    clean = block_scores(*score_args(c), block_size=c["block_size"], causal=causal)
    keep = _cells_below(c, c["used_kv_lens"])  # everything a query could ever see
    c2 = dict(c, index_k_cache=_poison(c, np.random.default_rng(layout["seed"]), keep=keep))
    poisoned = block_scores(*score_args(c2), block_size=c["block_size"], causal=causal)
    np.testing.assert_array_equal(poisoned, clean)


def test_R22_causal_future_position_never_read_and_visible_nan_propagates():
    c = make_case(11, B=1, S=2, ppb=2, msb=4, T=[5], lens=[14], holes=0.0, extra_cols=0)
    BS, bt = c["block_size"], c["block_tables"]
    clean = block_scores(*score_args(c), block_size=BS)
    p = 10  # seen by queries at positions >= 10 (i >= 1), in the future of query i = 0 (position 9)
    ik = c["index_k_cache"].copy()
    ik[bt[0, p // 2], :, p % 2] = np.nan
    got = block_scores(c["index_q"], ik, *score_args(c)[2:], block_size=BS)
    np.testing.assert_array_equal(got[0], clean[0])  # query 0 never reads position 10
    assert np.isnan(got[1:, :, p // BS]).all()  # a NaN logit makes its block's score NaN (R22)
    others = [s for s in range(4) if s != p // BS]
    np.testing.assert_array_equal(got[1:][:, :, others], clean[1:][:, :, others])


def test_R21_shared_index_head_equals_repeated_heads():
    c = make_case(5, Hkv=3, shared=True)
    rep = dict(c, index_k_cache=np.repeat(c["index_k_cache"], 3, axis=1))
    a = block_scores(*score_args(c), block_size=c["block_size"])
    b = block_scores(*score_args(rep), block_size=c["block_size"])
    assert_scores_close(a, b.astype(np.float64), score_bound(c, True))


def test_R34_gathered_index_keys_have_one_memory_layout_whatever_the_cache_layout():
    """The numpy block scores' matmul sees the same operands, strides included, for an HND cache
    and for the same logical cache in NHD (a transposed view): a BLAS may sum in another order
    for other strides, which gave last-bit differences between the layouts on one machine (R34
    asks for the same bits)."""
    rng = np.random.default_rng(3)
    hnd = rng.standard_normal((7, 2, 3, 4)).astype(np.float32)  # [P, Hk_idx, S, d]
    nhd_view = np.ascontiguousarray(hnd.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    bt, blocks, offs = np.array([0, 1, 2]), np.arange(1), np.arange(3)
    (ka, va, pa), (kb, vb, pb) = (numpy_impl._gather_keys(c, bt, blocks, 3, 1, 3, offs) for c in (hnd, nhd_view))
    assert ka.flags["C_CONTIGUOUS"] and kb.flags["C_CONTIGUOUS"] and ka.strides == kb.strides
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(va, vb)
    np.testing.assert_array_equal(pa, pb)


def test_R22_chunked_path_matches_reference(monkeypatch):
    monkeypatch.setattr(numpy_impl, "_CHUNK_ELEMS", 16)  # forces one block and one query per chunk
    c = make_case(7, B=2, msb=5, T=[4, 3], holes=0.2)
    got = block_scores(*score_args(c), block_size=c["block_size"])
    ref = block_scores_reference(*score_args(c), block_size=c["block_size"])
    assert_scores_close(got, ref, score_bound(c, True))


def test_R22_bfloat16_inputs_match_reference():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    c = make_case(13)
    c = dict(c, index_q=c["index_q"].astype(ml_dtypes.bfloat16),
             index_k_cache=c["index_k_cache"].astype(ml_dtypes.bfloat16))
    got = block_scores(*score_args(c), block_size=c["block_size"])
    ref = block_scores_reference(*score_args(c), block_size=c["block_size"])
    assert_scores_close(got, ref, score_bound(c, True))


def test_R22_no_pages_gives_minus_inf():
    iq = np.ones((2, 1, 4), np.float32)
    ik = np.ones((0, 1, 2, 4), np.float32)
    got = block_scores(iq, ik, np.full((1, 4), -1), np.array([0, 2]), block_size=2)
    assert got.shape == (2, 1, 4) and np.isneginf(got).all()


# --------------------------------------------------------------------------------------------
# R24: exp-free top-k
# --------------------------------------------------------------------------------------------

SPECIAL = [np.nan, -np.inf, np.inf, -0.0, 0.0, 1.0, 1.0, -1.0, 2.5]


@st.composite
def topk_cases(draw):
    B = draw(st.integers(1, 3))
    BS = draw(st.sampled_from([1, 2, 4]))
    msb = draw(st.integers(1, 7))
    T = draw(st.lists(st.integers(0, 4), min_size=B, max_size=B))
    lens = draw(st.lists(st.integers(0, msb * BS), min_size=B, max_size=B))
    Hkv = draw(st.integers(1, 3))
    Tq = sum(T)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):  # many ties, NaN, +-inf, signed zeros
        scores = rng.choice(np.array(SPECIAL, np.float32), size=(Tq, Hkv, msb))
    else:
        scores = rng.standard_normal((Tq, Hkv, msb)).astype(np.float32)
    return dict(scores=scores, cu=np.concatenate([[0], np.cumsum(T)]).astype(np.int64),
                lens=np.array(lens), block_size=BS, topk=draw(st.integers(1, msb + 2)))


@SETTINGS
@given(case=topk_cases(), force_local=st.booleans())
def test_R24_select_topk_equals_brute_force_sort(case, force_local):
    kw = dict(force_local=force_local, cu_seqlens_q=case["cu"], used_kv_lens=case["lens"],
              block_size=case["block_size"])
    got = select_topk(case["scores"], case["topk"], **kw)
    c = dict(cu_seqlens_q=case["cu"], used_kv_lens=case["lens"], block_size=case["block_size"])
    local = local_of(c) if force_local else [None] * case["scores"].shape[0]
    want = brute_topk(case["scores"], case["topk"], local)
    assert got.dtype == np.int32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(select_topk_reference(case["scores"], case["topk"], **kw), want)


@SETTINGS
@given(case=topk_cases())
def test_R24_local_block_always_first_and_rows_unique(case):
    c = dict(cu_seqlens_q=case["cu"], used_kv_lens=case["lens"], block_size=case["block_size"])
    got = select_topk(case["scores"], case["topk"], **c)
    msb = case["scores"].shape[2]
    for t, loc in enumerate(local_of(c)):
        if loc is not None:
            assert 0 <= loc < msb  # the own position is <= L_b - 1 < msb * BS
            assert (got[t, :, 0] == loc).all()
        for h in range(got.shape[1]):
            ids = got[t, h][got[t, h] >= 0]
            assert len(set(ids.tolist())) == len(ids)
            assert (got[t, h, len(ids):] == -1).all()  # -1 padding only at the end
    # a valid R6 selection: forward's own index builder accepts it
    psa.build_kvouter_index(got, np.zeros((len(case["cu"]) - 1, msb), np.int64), case["cu"], case["lens"],
                            block_size=case["block_size"], page_size=case["block_size"])


def test_R24_ties_signed_zeros_nan_and_padding():
    scores = np.array([[[0.0, np.nan, 1.0, -0.0, 1.0, -np.inf, np.inf]]], np.float32)
    got = select_topk(scores, 9, force_local=False)
    # +inf first, the two 1.0 by id, then the zeros (+0 and -0 tie: id 0 before id 3); NaN and -inf never
    np.testing.assert_array_equal(got[0, 0], [6, 2, 4, 0, 3, -1, -1, -1, -1])
    np.testing.assert_array_equal(select_topk(scores, 3, force_local=False)[0, 0], [6, 2, 4])
    np.testing.assert_array_equal(select_topk(-scores, 2, force_local=False)[0, 0], [5, 0])


def test_R24_forced_local_block_even_with_nan_or_minus_inf_score():
    scores = np.array([[[5.0, np.nan, 4.0]], [[5.0, 4.0, -np.inf]]], np.float32)
    # one sequence, L=6, T=2, BS=2: queries at positions 4 and 5 -> local block 2 for both
    got = select_topk(scores, 2, cu_seqlens_q=np.array([0, 2]), used_kv_lens=np.array([6]), block_size=2)
    np.testing.assert_array_equal(got[:, 0], [[2, 0], [2, 0]])
    got1 = select_topk(scores, 1, cu_seqlens_q=np.array([0, 2]), used_kv_lens=np.array([6]), block_size=2)
    np.testing.assert_array_equal(got1[:, 0], [[2], [2]])  # the local block is counted in topk


def test_R24_query_that_sees_nothing_has_no_local_block():
    # L=1, T=3: positions -2, -1, 0 -> only the last query has a local block (block 0)
    scores = np.array([[[1.0, 3.0]]] * 3, np.float32)
    got = select_topk(scores, 2, cu_seqlens_q=np.array([0, 3]), used_kv_lens=np.array([1]), block_size=4)
    np.testing.assert_array_equal(got[:, 0], [[1, 0], [1, 0], [0, 1]])


def test_R24_local_block_at_full_length_is_last_block():
    msb, BS = 3, 4
    scores = np.zeros((2, 1, msb), np.float32)
    got = select_topk(scores, 1, cu_seqlens_q=np.array([0, 2]), block_size=BS)  # L defaults to msb*BS
    np.testing.assert_array_equal(got[:, 0, 0], [msb - 1, msb - 1])


def test_R24_topk_zero_without_force_local_and_low_precision_scores():
    s = np.random.default_rng(0).standard_normal((3, 2, 5)).astype(np.float16)
    assert select_topk(s, 0, force_local=False).shape == (3, 2, 0)
    np.testing.assert_array_equal(select_topk(s, 3, force_local=False),
                                  select_topk(s.astype(np.float32), 3, force_local=False))


# --------------------------------------------------------------------------------------------
# R22 + R24 + R25: the pipeline
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(layout=layouts, topk=st.integers(1, 3), force_local=st.booleans())
def test_R22_R24_causal_never_selects_a_block_wholly_in_the_future(layout, topk, force_local):
    c = make_case(**layout)
    scores = block_scores(*score_args(c), block_size=c["block_size"])
    sel = select_topk(scores, topk, force_local=force_local, cu_seqlens_q=c["cu_seqlens_q"],
                      used_kv_lens=c["used_kv_lens"], block_size=c["block_size"])
    for t, (b, pos) in enumerate(query_pos(c)):
        ids = sel[t][sel[t] >= 0]
        assert (ids * c["block_size"] <= pos).all(), (t, pos, ids)


def _all_blocks(c):
    Tq, Hkv = c["index_q"].shape[:2]
    msb = c["block_tables"].shape[1] // (c["block_size"] // c["k_cache"].shape[2])
    return np.broadcast_to(np.arange(msb), (Tq, Hkv, msb)).copy(), msb


def _attn_tol():
    return 64 * F32_EPS  # float32 against the float64 oracle (R20)


@settings(max_examples=60, deadline=None)
@given(layout=layouts, causal=st.booleans(), extra=st.integers(0, 2))
def test_R25_topk_covering_all_visible_blocks_equals_dense(layout, causal, extra):
    c = make_case(**layout)
    selected, msb = _all_blocks(c)
    out, lse = sparse_attention(*attn_args(c), used_kv_lens=c["used_kv_lens"], block_size=c["block_size"],
                                topk=msb + extra, causal=causal, return_lse=True)
    ref, ref_lse = psa.dense_reference(c["q"], c["k_cache"], c["v_cache"], c["block_tables"], selected,
                                       c["cu_seqlens_q"], used_kv_lens=c["used_kv_lens"],
                                       block_size=c["block_size"], causal=causal)
    tol = _attn_tol()
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


@settings(max_examples=60, deadline=None)
@given(layout=layouts, causal=st.booleans(), topk=st.integers(1, 3))
def test_R25_sparse_attention_is_scores_then_topk_then_forward(layout, causal, topk):
    c = make_case(**layout)
    common = dict(used_kv_lens=c["used_kv_lens"], block_size=c["block_size"])
    out, lse = sparse_attention(*attn_args(c), **common, topk=topk, causal=causal, return_lse=True)
    scores = block_scores(*score_args(c), block_size=c["block_size"], causal=causal)
    sel = select_topk(scores, topk, cu_seqlens_q=c["cu_seqlens_q"], **common)
    fwd = psa.forward(c["q"], c["k_cache"], c["v_cache"], c["block_tables"], sel, c["cu_seqlens_q"], **common,
                      causal=causal, return_lse=True)
    np.testing.assert_array_equal(out, fwd[0])  # same backend, same steps: same bits (R19)
    np.testing.assert_array_equal(lse, fwd[1])
    ref, _ = psa.dense_reference(c["q"], c["k_cache"], c["v_cache"], c["block_tables"], sel, c["cu_seqlens_q"],
                                 **common, causal=causal)
    np.testing.assert_allclose(out, ref, rtol=_attn_tol(), atol=_attn_tol())


def test_R19_deterministic():
    c = make_case(21, B=3, msb=5, T=[3, 1, 2])
    a = sparse_attention(*attn_args(c), used_kv_lens=c["used_kv_lens"], block_size=c["block_size"], topk=2)
    b = sparse_attention(*attn_args(c), used_kv_lens=c["used_kv_lens"], block_size=c["block_size"], topk=2)
    np.testing.assert_array_equal(a, b)
    s = block_scores(*score_args(c), block_size=c["block_size"])
    np.testing.assert_array_equal(s, block_scores(*score_args(c), block_size=c["block_size"]))


# --------------------------------------------------------------------------------------------
# Validation (R17 with the index-branch rules), backends (R18)
# --------------------------------------------------------------------------------------------

class SpyBackend(NumpyBackend):
    """The numpy backend, counting every call that would do work."""

    name = "spy"

    def __init__(self):
        self.calls = 0

    def block_scores(self, problem):
        self.calls += 1
        return super().block_scores(problem)

    def select_topk(self, problem):
        self.calls += 1
        return super().select_topk(problem)

    def forward(self, problem, index):
        self.calls += 1
        return super().forward(problem, index)


BASE = make_case(1, B=2, S=2, ppb=2, msb=3, Hkv=2, T=[2, 1], lens=[12, 5])


def _bad_scores(**changes):
    c = dict(BASE, **changes)
    kw = dict(block_size=c.pop("block_size"), causal=c.pop("causal", True), softmax_scale=c.pop("softmax_scale", None))
    return score_args(c), kw


F64 = np.float64
BAD_SCORE_INPUTS = [
    ("R21", dict(index_q=BASE["index_q"][0])),  # 2-D
    ("R21", dict(index_k_cache=BASE["index_k_cache"][0])),  # 3-D
    ("R21", dict(index_k_cache=np.zeros((10, 2, 2, 7), np.float32))),  # d_idx mismatch
    ("R21", dict(index_q=np.zeros((3, 3, 8), np.float32), index_k_cache=np.zeros((10, 2, 2, 8), np.float32))),
    ("R7", dict(index_q=BASE["index_q"].astype(F64))),
    ("R7", dict(index_k_cache=BASE["index_k_cache"].astype(np.int32))),
    ("R7", dict(index_q=[[[1.0]]])),
    ("R2", dict(block_tables=np.where(BASE["block_tables"] == 0, 99, BASE["block_tables"]))),
    ("R3", dict(cu_seqlens_q=np.array([0, 2, 4]))),
    ("R4", dict(used_kv_lens=np.array([13, 5]))),
    ("R5", dict(block_size=3)),
    ("R8", dict(softmax_scale=float("nan"))),
    ("R8", dict(causal=1)),
]


@pytest.mark.parametrize("rule,changes", BAD_SCORE_INPUTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_SCORE_INPUTS)])
def test_R17_R21_block_scores_validation(rule, changes):
    spy = SpyBackend()
    args, kw = _bad_scores(**changes)
    with pytest.raises(psa.SpecError, match=rf"^block_scores\(\): .*\[{rule}\]$") as info:
        block_scores(*args, **kw, backend=spy)
    assert info.value.rule == rule and spy.calls == 0


SC = np.zeros((3, 2, 4), np.float32)
CU = np.array([0, 2, 3])
BAD_TOPK_INPUTS = [
    ("R23", (SC.astype(F64), 2), dict(force_local=False)),
    ("R23", (SC[0], 2), dict(force_local=False)),
    ("R23", (np.zeros((3, 2, 0), np.float32), 1), dict(force_local=False)),
    ("R23", (SC, -1), dict(force_local=False)),
    ("R23", (SC, 2.0), dict(force_local=False)),
    ("R23", (SC, True), dict(force_local=False)),
    ("R23", (SC, 0), dict(cu_seqlens_q=CU, block_size=4)),  # topk 0 with force_local
    ("R23", (SC, 2), dict(block_size=4)),  # force_local without cu_seqlens_q
    ("R23", (SC, 2), dict(cu_seqlens_q=CU)),  # force_local without block_size
    ("R23", (SC, 2), dict(force_local=1, cu_seqlens_q=CU, block_size=4)),
    ("R23", (SC, 2), dict(force_local=False, used_kv_lens=np.array([1, 1]))),
    ("R3", (SC, 2), dict(cu_seqlens_q=np.array([0, 2, 4]), block_size=4)),
    ("R3", (SC, 2), dict(cu_seqlens_q=np.array([0, 3, 2, 3]), block_size=4)),
    ("R4", (SC, 2), dict(cu_seqlens_q=CU, block_size=4, used_kv_lens=np.array([17, 1]))),
    ("R4", (SC, 2), dict(cu_seqlens_q=CU, block_size=4, used_kv_lens=np.array([1]))),
    ("R5", (SC, 2), dict(cu_seqlens_q=CU, block_size=0)),
]


@pytest.mark.parametrize("rule,args,kw", BAD_TOPK_INPUTS, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD_TOPK_INPUTS)])
def test_R17_R23_select_topk_validation(rule, args, kw):
    spy = SpyBackend()
    with pytest.raises(psa.SpecError, match=rf"^select_topk\(\): .*\[{rule}\]$") as info:
        select_topk(*args, **kw, backend=spy)
    assert info.value.rule == rule and spy.calls == 0


BAD_PIPELINE = [
    ("R25", dict(index_q=BASE["index_q"][:2])),  # Tq differs from q
    ("R25", dict(index_q=np.zeros((3, 1, 8), np.float32))),  # Hkv differs from k_cache
    ("R25", dict(index_k_cache=BASE["index_k_cache"][:-1])),  # P differs
    ("R25", dict(index_k_cache=np.zeros((BASE["k_cache"].shape[0], 1, 1, 8), np.float32))),  # S differs
    ("R21", dict(index_k_cache=np.zeros((BASE["k_cache"].shape[0], 3, 2, 8), np.float32))),
    ("R23", dict(topk=0)),
    ("R1", dict(q=BASE["q"][:, :3])),
]


@pytest.mark.parametrize("rule,changes", BAD_PIPELINE, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_PIPELINE)])
def test_R17_R25_sparse_attention_validation(rule, changes):
    spy = SpyBackend()
    c = dict(BASE, **changes)
    topk = c.pop("topk", 2)
    with pytest.raises(psa.SpecError, match=rf"^sparse_attention\(\): .*\[{rule}\]$") as info:
        sparse_attention(*attn_args(c), used_kv_lens=c["used_kv_lens"], block_size=c["block_size"], topk=topk,
                         backend=spy)
    assert info.value.rule == rule and spy.calls == 0


def test_R18_backend_without_index_branch_is_unsupported():
    from paged_sparse_attn.backends.base import Backend

    class NoIndex(Backend):
        name = "no-index"

        @property
        def capabilities(self):
            return psa.Capabilities()

        def forward_partials(self, problem, index):  # pragma: no cover - never reached
            raise AssertionError("forward must not run")

    with pytest.raises(psa.UnsupportedError, match="no-index.*block_scores"):
        sparse_attention(*attn_args(BASE), used_kv_lens=BASE["used_kv_lens"], block_size=BASE["block_size"],
                         topk=2, backend=NoIndex())
    with pytest.raises(psa.UnsupportedError, match="select_topk"):
        select_topk(SC, 1, force_local=False, backend=NoIndex())


def test_R25_user_guide_example_runs_and_prints_what_it_shows():
    text = (Path(__file__).resolve().parents[1] / "docs" / "index-branch.md").read_text()
    code = re.search(r"## Example.*?```python\n(.*?)```", text, re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/index-branch.md", "exec"), {})
    # printed arrays are shown as comments "# [...]", optionally followed by 3+ spaces and a note
    shown = [re.split(r"\s{3,}", ln[1:].strip())[0] for ln in code.splitlines() if re.match(r"#\s+\[", ln)]
    printed = [ln.strip() for ln in buf.getvalue().splitlines()]
    assert printed == shown


def test_R18_device_index_keys_need_their_own_backend():
    class FakeDevice(psa.DeviceArray):
        def __init__(self, like, backend):
            self.shape, self.dtype, self.backend = like.shape, like.dtype, backend

    other = SpyBackend()
    dev = FakeDevice(BASE["index_k_cache"], other)
    args = (BASE["index_q"], dev, *score_args(BASE)[2:])
    with pytest.raises(psa.UnsupportedError, match="device array"):
        block_scores(*args, block_size=BASE["block_size"], backend="numpy")  # held by another backend
    with pytest.raises(psa.UnsupportedError, match="spy.*does not accept device-resident arrays"):
        block_scores(*args, block_size=BASE["block_size"])  # its owner, by capabilities, before any work
    assert other.calls == 0
