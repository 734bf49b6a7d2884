"""The contract, rule by rule (R1-R20): hand-computed cases whose expected numbers are written
as formulas in the test, plus seeded problems for the rules about what must *not* matter.

Test names carry the rule id they check.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.testing import AttentionProblem, assert_attention_close, tolerance
from paged_sparse_attn.testing.generate import random_problem
from paged_sparse_attn.testing.oracle import attended_mask

BACKEND = "numpy"
f32 = np.float32


def run(pb: AttentionProblem, **kw):
    """forward(..., return_lse=True) on the problem."""
    return psa.forward(*pb.args, **{**pb.options, **kw}, backend=BACKEND, return_lse=True)


def reference(pb: AttentionProblem, **kw):
    return psa.dense_reference(*pb.args, **{**pb.options, **kw})


def one_sequence(k, v, page_size):
    """Caches holding one sequence's K/V [L, Hkv, D] contiguously: page j is physical page j."""
    k, v = np.asarray(k, f32), np.asarray(v, f32)
    L, Hkv, D = k.shape
    P = -(-L // page_size)
    kc = np.zeros((P, Hkv, page_size, D), f32)
    vc = np.zeros((P, Hkv, page_size, D), f32)
    for p in range(L):
        kc[p // page_size, :, p % page_size] = k[p]
        vc[p // page_size, :, p % page_size] = v[p]
    return kc, vc, np.arange(P)[None, :]


# --- R1: shapes and the GQA mapping ------------------------------------------------------------

def test_R1_query_head_reads_kv_head_hq_floordiv_G():
    # Hkv=2, G=3: contiguous groups (hq // 3), not interleaved (hq % 2).
    Hkv, G, D, n = 2, 3, 2, 4
    k = np.zeros((n, Hkv, D), f32)
    k[:, 1, 0] = 1.0  # head 1: every logit is q.k = 1; head 0: every logit is 0
    v = np.zeros((n, Hkv, D), f32)
    v[:, 0] = 10.0
    v[:, 1] = 20.0
    kc, vc, bt = one_sequence(k, v, page_size=2)
    q = np.ones((2, Hkv * G, D), f32)
    pb = AttentionProblem(q, kc, vc, bt, np.array([[[0, 1]] * Hkv] * 2), np.array([0, 2]), None, block_size=2,
                          softmax_scale=1.0)
    out, lse = run(pb)
    for hq in range(Hkv * G):
        h = hq // G
        assert np.all(out[:, hq] == 10.0 * (h + 1)), hq
        # lse = ln(n * e^h) = h + ln n
        np.testing.assert_allclose(lse[:, hq], h + math.log(n), rtol=tolerance(f32).out)


def test_R1_output_shapes_and_dtypes():
    pb = random_problem(1, seqlens_q=(3, 2), Hkv=2, G=3, D=5)
    out, lse = run(pb)
    assert out.shape == (5, 6, 5) and out.dtype == np.float32
    assert lse.shape == (5, 6) and lse.dtype == np.float32


# --- R2 / R3: paged layout and packed sequences -----------------------------------------------

def test_R2_block_table_maps_logical_pages_to_scrambled_physical_pages():
    # S=2, L=3: logical positions 0,1 live in physical page 2, position 2 in page 0 slot 0.
    S, D = 2, 1
    kc = np.zeros((3, 1, S, D), f32)  # q = 0: uniform weights, out = mean of attended v
    vc = np.full((3, 1, S, D), np.nan, f32)
    vc[2, 0, :, 0] = [1.0, 2.0]
    vc[0, 0, 0, 0] = 6.0  # position 3 (page 0 slot 1) is >= L: stays NaN; page 1 is unmapped
    bt = np.array([[2, 0, -1, 1]])
    pb = AttentionProblem(np.zeros((1, 1, D), f32), kc, vc, bt, np.array([[[0, 1]]]), np.array([0, 1]),
                          np.array([3]), block_size=2 * S)
    out, lse = run(pb)
    assert out[0, 0, 0] == pytest.approx((1 + 2 + 6) / 3, rel=tolerance(f32).out)
    assert lse[0, 0] == pytest.approx(math.log(3), rel=tolerance(f32).out)


def test_R3_queries_use_their_own_sequence_and_empty_sequences_are_allowed():
    # three sequences, the middle one empty; each has its own page and length
    S, D = 2, 1
    kc = np.zeros((3, 1, S, D), f32)
    vc = np.zeros((3, 1, S, D), f32)
    vc[0, 0, :, 0] = [1.0, 3.0]  # seq 0: L=2 -> mean 2
    vc[1, 0, :, 0] = [100.0, 100.0]  # seq 1 (no queries)
    vc[2, 0, :, 0] = [7.0, np.nan]  # seq 2: L=1 -> 7, position 1 never read
    bt = np.array([[0], [1], [2]])
    q = np.zeros((3, 1, D), f32)
    sel = np.zeros((3, 1, 1), np.int64)
    pb = AttentionProblem(q, kc, vc, bt, sel, np.array([0, 2, 2, 3]), np.array([2, 2, 1]), block_size=S)
    out, _ = run(pb)
    assert out[:, 0, 0].tolist() == [2.0, 2.0, 7.0]


# --- R4 / R5: lengths and the msb cut ----------------------------------------------------------

def test_R4_default_used_kv_lens_is_msb_times_block_size():
    # max_pages=5, ppb=2 -> msb=2, default L = 8: all 8 positions of both blocks are attended
    S, D = 2, 1
    kc = np.zeros((5, 1, S, D), f32)
    vc = np.arange(10, dtype=f32).reshape(5, 1, S, D)  # v at logical position p = p
    vc[4] = np.nan  # the page past msb*ppb (R5)
    bt = np.arange(5)[None, :]
    pb = AttentionProblem(np.zeros((1, 1, D), f32), kc, vc, bt, np.array([[[0, 1]]]), np.array([0, 1]), None,
                          block_size=2 * S)
    out, lse = run(pb)
    assert out[0, 0, 0] == pytest.approx(sum(range(8)) / 8, rel=tolerance(f32).out)
    assert lse[0, 0] == pytest.approx(math.log(8), rel=tolerance(f32).out)
    out2, lse2 = run(pb.replace(used_kv_lens=np.array([8])))
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


def test_R4_used_kv_lens_cuts_inside_a_block_and_zero_means_nothing():
    S, D = 2, 1
    kc = np.zeros((2, 1, S, D), f32)
    vc = np.arange(4, dtype=f32).reshape(2, 1, S, D)
    bt = np.array([[0, 1], [0, 1]])
    pb = AttentionProblem(np.zeros((2, 1, D), f32), kc, vc, bt, np.zeros((2, 1, 1), np.int64),
                          np.array([0, 1, 2]), np.array([3, 0]), block_size=2 * S)
    out, lse = run(pb)
    assert out[0, 0, 0] == pytest.approx((0 + 1 + 2) / 3, rel=tolerance(f32).out)
    assert out[1, 0, 0] == 0.0 and lse[1, 0] == -np.inf


@pytest.mark.parametrize("seed", range(4))
def test_R5_pages_past_msb_blocks_are_never_read(seed):
    pb = random_problem(seed, tail_pages=3, ppb=2, msb=2, hole_prob=0.0)
    tail = pb.block_tables[:, 4:]
    assert (tail >= 0).all()
    pb.k_cache[tail.ravel()] = np.nan  # every tail page poisoned (the generator owns them)
    pb.v_cache[tail.ravel()] = np.inf
    out, lse = run(pb)
    ref, ref_lse = reference(pb)
    assert_attention_close(out, ref, dtype=f32, lse=lse, ref_lse=ref_lse)


# --- R6: slot order and padding ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_R6_slot_order_and_minus_one_padding_do_not_matter(seed):
    pb = random_problem(seed, seqlens_q=(3, 2), msb=4, topk=3, causal=bool(seed % 2))
    out, lse = run(pb)
    rng = np.random.default_rng(seed)
    sel = pb.selected
    Tq, Hkv, K = sel.shape
    padded = np.full((Tq, Hkv, K + 3), -1, sel.dtype)
    padded[..., :K] = sel
    for t in range(Tq):
        for h in range(Hkv):
            padded[t, h] = rng.permutation(padded[t, h])
    out2, lse2 = run(pb.replace(selected=padded))
    assert_attention_close(out2, out.astype(np.float64), dtype=f32, lse=lse2, ref_lse=lse.astype(np.float64))


# --- R7: dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_R7_any_integer_dtype_for_index_arrays(dt):
    signed = np.issubdtype(dt, np.signedinteger)
    pb = random_problem(3, hole_prob=0.3 if signed else 0.0, fill=0.6 if signed else 1.0, topk=3, msb=3)
    if not signed:
        assert (pb.selected >= 0).all() and (pb.block_tables >= 0).all()
    base = run(pb)
    cast = pb.replace(block_tables=pb.block_tables.astype(dt), selected=pb.selected.astype(dt),
                    cu_seqlens_q=pb.cu_seqlens_q.astype(dt), used_kv_lens=pb.used_kv_lens.astype(dt))
    got = run(cast)
    np.testing.assert_array_equal(got[0], base[0])
    np.testing.assert_array_equal(got[1], base[1])


@pytest.mark.parametrize("q_dt,kv_dt", [(np.float16, np.float16), (np.float32, np.float16), (np.float16, np.float32)])
def test_R7_float16_queries_and_caches(q_dt, kv_dt):
    pb = random_problem(5, dtype=kv_dt, q_dtype=q_dt, seqlens_q=(3, 1), D=8)
    out, lse = run(pb)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref, ref_lse = reference(pb)
    assert_attention_close(out, ref, dtype=np.float16, lse=lse, ref_lse=ref_lse)


# --- R8: scale and causal ------------------------------------------------------------------------

def test_R8_default_softmax_scale_is_one_over_sqrt_D():
    D = 4
    k = np.zeros((2, 1, D), f32)
    k[0, 0, 0] = 3.0  # q.k = 3 at position 0, 0 at position 1; default scale 1/2
    v = np.array([[[1.0] * D], [[0.0] * D]], f32)
    kc, vc, bt = one_sequence(k, v, page_size=2)
    pb = AttentionProblem(np.ones((1, 1, D), f32), kc, vc, bt, np.array([[[0]]]), np.array([0, 1]), None, block_size=2)
    out, lse = run(pb)
    e0, e1 = math.exp(3 / 2), math.exp(0.0)
    np.testing.assert_allclose(out[0, 0], e0 / (e0 + e1), rtol=tolerance(f32).out)
    assert lse[0, 0] == pytest.approx(math.log(e0 + e1), rel=tolerance(f32).out)
    out2, _ = run(pb.replace(softmax_scale=0.5))
    np.testing.assert_array_equal(out, out2)
    out3, _ = run(pb.replace(softmax_scale=-1.0))  # any finite scale, negative included
    np.testing.assert_allclose(out3[0, 0], math.exp(-3) / (math.exp(-3) + 1), rtol=tolerance(f32).out)


def test_R8_numpy_bool_is_a_bool_for_causal():
    pb = random_problem(2, causal=True)
    a = run(pb)
    b = run(pb.replace(causal=np.bool_(True)))
    np.testing.assert_array_equal(a[0], b[0])


# --- R9: the attended set ------------------------------------------------------------------------

def _positional(L, S, D=1):
    """One sequence of L positions with k = 0 (uniform weights) and v[p] = p; NaN past L."""
    P = -(-L // S) + 1
    kc = np.zeros((P, 1, S, D), f32)
    vc = np.full((P, 1, S, D), np.nan, f32)
    for p in range(L):
        vc[p // S, 0, p % S] = p
    return kc, vc, np.arange(P)[None, :]


def test_R9_right_aligned_causal_worked_example():
    # L_b = 10, T_b = 3: query i sees positions <= 10 - 3 + i = 7 + i.
    L, T, S, BS = 10, 3, 2, 4
    kc, vc, bt = _positional(L, S)
    bt = np.arange(6)[None, :]  # msb = 3 blocks of 4 = 12 positions, 10 used
    kc = np.concatenate([kc, np.zeros((6 - kc.shape[0],) + kc.shape[1:], f32)])
    vc = np.concatenate([vc, np.full((6 - vc.shape[0],) + vc.shape[1:], np.nan, f32)])
    pb = AttentionProblem(np.zeros((T, 1, 1), f32), kc, vc, bt, np.tile([[[2, 0, 1]]], (T, 1, 1)),
                          np.array([0, T]), np.array([L]), block_size=BS, causal=True)
    out, lse = run(pb)
    for i in range(T):
        n = 8 + i  # positions 0 .. 7+i, uniform weights
        assert out[i, 0, 0] == pytest.approx((7 + i) / 2, rel=tolerance(f32).out), i
        assert lse[i, 0] == pytest.approx(math.log(n), rel=tolerance(f32).out), i
    # without causal every query sees 0..9
    out_nc, lse_nc = run(pb.replace(causal=False))
    assert np.allclose(out_nc[:, 0, 0], 4.5, rtol=tolerance(f32).out)
    assert np.allclose(lse_nc[:, 0], math.log(10), rtol=tolerance(f32).out)


def test_R9_causal_with_more_queries_than_keys_leaves_early_queries_empty():
    # L_b = 2, T_b = 4: query i sees p <= i - 2, so queries 0 and 1 see nothing.
    kc, vc, bt = _positional(2, 2)
    v = vc.copy()
    v[0, 0, 0, 0], v[0, 0, 1, 0] = 5.0, 9.0
    pb = AttentionProblem(np.zeros((4, 1, 1), f32), kc, v, bt[:, :1], np.zeros((4, 1, 1), np.int64),
                          np.array([0, 4]), np.array([2]), block_size=2, causal=True)
    out, lse = run(pb)
    assert out[:2].tolist() == [[[0.0]], [[0.0]]]
    assert lse[:2, 0].tolist() == [-np.inf, -np.inf]
    assert out[2, 0, 0] == 5.0 and lse[2, 0] == 0.0  # ln(e^0)
    assert out[3, 0, 0] == pytest.approx(7.0, rel=tolerance(f32).out)
    assert lse[3, 0] == pytest.approx(math.log(2), rel=tolerance(f32).out)


def test_R9_unmapped_pages_inside_a_selected_block_are_skipped():
    S, D = 2, 1
    kc = np.zeros((2, 1, S, D), f32)
    vc = np.zeros((2, 1, S, D), f32)
    vc[1, 0, :, 0] = [4.0, 8.0]
    kc[0], vc[0] = np.nan, np.nan  # physical page 0 is referenced by nobody
    bt = np.array([[-1, 1]])  # block 0 = logical pages 0 (unmapped) and 1 (physical 1)
    pb = AttentionProblem(np.zeros((1, 1, D), f32), kc, vc, bt, np.array([[[0]]]), np.array([0, 1]), None,
                          block_size=2 * S)
    out, lse = run(pb)
    assert out[0, 0, 0] == pytest.approx(6.0, rel=tolerance(f32).out)
    assert lse[0, 0] == pytest.approx(math.log(2), rel=tolerance(f32).out)


@pytest.mark.parametrize("causal", [False, True])
def test_R9_seeded_problems_match_an_independent_attended_set(causal):
    # forward against a direct softmax over the attended mask of the oracle (not the package)
    pb = random_problem(11, seqlens_q=(4, 0, 3), causal=causal, poison=False, used="random")
    mask = attended_mask(pb)
    out, lse = run(pb)
    S, G = pb.page_size, pb.group_size
    exp = np.zeros(out.shape)
    exp_lse = np.full(lse.shape, -np.inf)
    b_of = np.repeat(np.arange(len(pb.cu_seqlens_q) - 1), np.diff(pb.cu_seqlens_q))
    for t in range(out.shape[0]):
        for hq in range(out.shape[1]):
            h = hq // G
            pos = np.flatnonzero(mask[t, h])
            if not pos.size:
                continue
            pages = pb.block_tables[b_of[t], pos // S]
            k = pb.k_cache[pages, h, pos % S].astype(np.float64)
            v = pb.v_cache[pages, h, pos % S].astype(np.float64)
            s = (k @ pb.q[t, hq]) / math.sqrt(pb.q.shape[2])
            w = np.exp(s - s.max())
            exp[t, hq] = w @ v / w.sum()
            exp_lse[t, hq] = s.max() + math.log(w.sum())
    assert_attention_close(out, exp, dtype=f32, lse=lse, ref_lse=exp_lse)


# --- R10: unattended memory never leaks ---------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_R10_nan_and_inf_in_unattended_memory_never_leak(seed):
    pb = random_problem(seed, seqlens_q=(3, 0, 2, 1), causal=bool(seed % 2), tail_pages=2, spare_pages=3,
                      share_prob=0.2 if seed % 4 == 3 else 0.0, dtype=np.float16 if seed % 3 == 2 else f32)
    assert pb.poisoned_cells > 0
    clean = pb.replace(k_cache=np.nan_to_num(pb.k_cache, nan=0.5, posinf=-0.25, neginf=0.75),
                     v_cache=np.nan_to_num(pb.v_cache, nan=0.5, posinf=-0.25, neginf=0.75))
    out, lse = run(pb)
    out_c, lse_c = run(clean)
    assert_attention_close(out, out_c.astype(np.float64), dtype=f32, lse=lse, ref_lse=lse_c.astype(np.float64))
    ref, ref_lse = reference(clean)
    assert_attention_close(out, ref, dtype=pb.k_cache.dtype, lse=lse, ref_lse=ref_lse)


def test_R10_future_positions_attended_by_a_later_query_do_not_leak_into_an_earlier_one():
    # one block, two causal queries; position 1 is visible to query 1 only and holds NaN in K and V
    kc, vc, bt = _positional(2, 2)
    kc[0, 0, 1, 0] = np.nan
    vc[0, 0, 1, 0] = np.nan
    pb = AttentionProblem(np.zeros((2, 1, 1), f32), kc, vc, bt[:, :1], np.zeros((2, 1, 1), np.int64),
                          np.array([0, 2]), np.array([2]), block_size=2, causal=True)
    out, lse = run(pb)
    assert out[0, 0, 0] == 0.0 and lse[0, 0] == 0.0  # query 0 sees position 0 only: v=0, ln(e^0)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_R10_unselected_block_poison(value):
    S = 2
    kc = np.zeros((2, 1, S, 1), f32)
    vc = np.ones((2, 1, S, 1), f32)
    kc[1], vc[1] = value, value  # block 1 is selected by nobody
    pb = AttentionProblem(np.ones((1, 1, 1), f32), kc, vc, np.array([[0, 1]]), np.array([[[0, -1]]]),
                          np.array([0, 1]), None, block_size=S)
    out, lse = run(pb)
    assert out[0, 0, 0] == 1.0 and lse[0, 0] == pytest.approx(math.log(2), rel=tolerance(f32).out)


# --- R11: the result of a row --------------------------------------------------------------------

def test_R11_lse_is_the_natural_log_of_the_explicit_sum():
    a, b, c = 0.75, -1.5, 2.25  # logits with scale 1, D = 1, q = 1
    k = np.array([[[a]], [[b]], [[c]]], f32)
    v = np.array([[[1.0]], [[-2.0]], [[4.0]]], f32)
    kc, vc, bt = one_sequence(k, v, page_size=1)
    pb = AttentionProblem(np.ones((1, 1, 1), f32), kc, vc, bt, np.array([[[0, 1, 2]]]), np.array([0, 1]), None,
                          block_size=1, softmax_scale=1.0)
    out, lse = run(pb)
    ea, eb, ec = math.exp(a), math.exp(b), math.exp(c)
    assert lse[0, 0] == pytest.approx(float(np.log(ea + eb + ec)), rel=tolerance(f32).out)
    assert abs(lse[0, 0] - np.log2(ea + eb + ec)) > 0.1  # not base 2
    assert out[0, 0, 0] == pytest.approx((1 * ea - 2 * eb + 4 * ec) / (ea + eb + ec), rel=tolerance(f32).out)


def test_R11_empty_rows_give_zero_and_minus_inf():
    pb = random_problem(4, seqlens_q=(2, 2), used=[0, 8], msb=2, ppb=2, page_size=2, fill=0.5)
    pb.selected[2:, 0] = -1  # seq 1, KV head 0: nothing selected
    out, lse = run(pb)
    G = pb.group_size
    assert (out[:2] == 0).all() and np.isneginf(lse[:2]).all()  # L_0 = 0
    assert (out[2:, :G] == 0).all() and np.isneginf(lse[2:, :G]).all()
    ref, ref_lse = reference(pb)
    assert_attention_close(out, ref, dtype=f32, lse=lse, ref_lse=ref_lse)


# --- R12: no finite minus infinity ----------------------------------------------------------------

def _logit_problem(q_row, k_rows, v_rows):
    """One query, one head, scale 1; k_rows/v_rows are [n, D] at positions 0..n-1."""
    k = np.asarray(k_rows, f32)[:, None, :]
    v = np.asarray(v_rows, f32)[:, None, :]
    kc, vc, bt = one_sequence(k, v, page_size=1)
    n = k.shape[0]
    return AttentionProblem(np.asarray(q_row, f32)[None, None, :], kc, vc, bt, np.arange(n)[None, None, :],
                   np.array([0, 1]), None, block_size=1, softmax_scale=1.0)


@pytest.mark.parametrize("base", [-1e6, 1e6, -3e6])
def test_R12_rows_of_huge_logits_are_exact(base):
    # q = [base/1000, 1], k_j = [1000, c_j]: logits base + c_j, exact in float32 (integers < 2^24)
    cs = [0.0, 1.0, 3.0, -2.0]
    vs = [1.0, 2.0, -1.0, 5.0]
    pb = _logit_problem([base / 1000, 1.0], [[1000.0, c] for c in cs], [[x, 0.0] for x in vs])
    out, lse = run(pb)
    w = [math.exp(c) for c in cs]  # softmax is shift invariant: weights e^{c_j}
    assert out[0, 0, 0] == pytest.approx(sum(wi * x for wi, x in zip(w, vs)) / sum(w), rel=tolerance(f32).out)
    assert lse[0, 0] == pytest.approx(base + math.log(sum(w)), rel=tolerance(f32).out)
    ref, ref_lse = reference(pb)
    assert_attention_close(out, ref, dtype=f32, lse=lse, ref_lse=ref_lse)


def test_R12_logits_below_any_finite_sentinel_still_count():
    # logits -2^100 and -2^100 - 2^78 (exact in float32): far below -1e30, a common "minus infinity"
    big = 2.0 ** 50
    pb = _logit_problem([big], [[-big], [-(big + 2.0 ** 28)]], [[3.0], [7.0]])
    out, lse = run(pb)
    assert out[0, 0, 0] == 3.0  # weight of the second is exp(-2^78) = 0
    assert lse[0, 0] == np.float32(-(2.0 ** 100))


# --- R13: the KV-outer index ------------------------------------------------------------------

def _hand_index_inputs():
    # B=2 (T = 2, 1), Hkv=2, S=2, BS=4 -> ppb=2, max_pages=4 -> msb=2; L = (8, 3)
    sel = np.array([
        [[1, 0], [-1, 1]],   # t0 (seq 0, i=0)
        [[0, -1], [1, 0]],   # t1 (seq 0, i=1)
        [[1, 0], [-1, -1]],  # t2 (seq 1, i=0): block 1 starts at 4 >= L_1 = 3 -> dropped
    ])
    bt = np.array([[0, 1, 2, 3], [4, 5, -1, -1]])
    return sel, bt, np.array([0, 2, 3]), np.array([8, 3])


def test_R13_index_structure_on_a_hand_example():
    sel, bt, cu, lens = _hand_index_inputs()
    ix = psa.build_kvouter_index(sel, bt, cu, lens, block_size=4, page_size=2)
    # edges ordered by h, then (b, s), then t:
    #   h0: (0,0): t0 rank1, t1 rank0 | (0,1): t0 rank0 | (1,0): t2 rank1 (len 3 = L_1)
    #   h1: (0,0): t1 rank1 | (0,1): t0 rank1, t1 rank0
    assert ix.edge_query.tolist() == [0, 1, 0, 2, 1, 0, 1]
    assert ix.edge_head.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert ix.edge_seq.tolist() == [0, 0, 0, 1, 0, 0, 0]
    assert ix.edge_block.tolist() == [0, 0, 1, 0, 0, 1, 1]
    assert ix.edge_rank.tolist() == [1, 0, 0, 1, 1, 1, 0]
    assert ix.edge_len.tolist() == [4, 4, 4, 3, 4, 4, 4]
    assert ix.slot_ptr.tolist() == [0, 2, 3, 4, 5, 7]
    assert ix.slot_head.tolist() == [0, 0, 0, 1, 1]
    assert ix.slot_seq.tolist() == [0, 0, 1, 0, 0]
    assert ix.slot_block.tolist() == [0, 1, 0, 0, 1]
    # rows r = t*Hkv + h, edges in rank order
    assert ix.row_ptr.tolist() == [0, 2, 3, 4, 6, 7, 7]
    assert ix.row_edges.tolist() == [2, 0, 5, 1, 6, 4, 3]
    assert (ix.num_edges, ix.num_slots, ix.msb, ix.num_queries, ix.num_kv_heads) == (7, 5, 2, 3, 2)
    for a in (ix.edge_query, ix.edge_len, ix.slot_ptr, ix.row_ptr, ix.row_edges):
        assert a.dtype == np.int32 and a.flags.c_contiguous


def test_R13_causal_drops_blocks_entirely_in_the_future_and_shortens_edge_len():
    sel, bt, cu, _ = _hand_index_inputs()
    # L = (5, 3), causal: t0 (i=0, T=2) sees p <= 3 -> block 1 (start 4) dropped; t1 sees p <= 4 -> len 1
    ix = psa.build_kvouter_index(sel, bt, cu, np.array([5, 3]), block_size=4, page_size=2, causal=True)
    #   h0: (0,0): t0 len 4, t1 len 4 | (1,0): t2 len 3 (sees p <= 2)
    #   h1: (0,0): t1 len 4 | (0,1): t1 len 1
    assert ix.edge_query.tolist() == [0, 1, 2, 1, 1]
    assert ix.edge_head.tolist() == [0, 0, 0, 1, 1]
    assert ix.edge_block.tolist() == [0, 0, 0, 0, 1]
    assert ix.edge_len.tolist() == [4, 4, 3, 4, 1]
    assert ix.slot_ptr.tolist() == [0, 2, 3, 4, 5]
    assert ix.row_ptr.tolist() == [0, 1, 1, 2, 4, 5, 5]
    assert ix.row_edges.tolist() == [0, 1, 4, 3, 2]


def test_R13_edges_with_unmapped_pages_are_kept():
    sel, bt, cu, lens = _hand_index_inputs()
    bt = bt.copy()
    bt[0, 2:] = -1  # block 1 of seq 0 fully unmapped: still an edge (its partial is empty, R14)
    ix = psa.build_kvouter_index(sel, bt, cu, lens, block_size=4, page_size=2)
    assert ix.num_edges == 7


# --- R14: partials ----------------------------------------------------------------------------

def test_R14_partials_of_one_edge_by_hand():
    a, b = 1.5, -0.5  # scaled scores of the two positions
    k = np.array([[[a]], [[b]]], f32)
    v = np.array([[[2.0]], [[6.0]]], f32)
    kc, vc, bt = one_sequence(k, v, page_size=2)
    ix = psa.build_kvouter_index(np.array([[[0]]]), bt, np.array([0, 1]), block_size=2, page_size=2)
    pt = psa.forward_partials(np.ones((1, 1, 1), f32), kc, vc, ix, softmax_scale=1.0, backend=BACKEND)
    assert pt.o.shape == (1, 1, 1) and pt.m.shape == (1, 1) and pt.l.shape == (1, 1)
    assert pt.m[0, 0] == np.float32(a)
    assert pt.l[0, 0] == pytest.approx(1 + math.exp(b - a), rel=tolerance(f32).out)
    assert pt.o[0, 0, 0] == pytest.approx(2.0 + 6.0 * math.exp(b - a), rel=tolerance(f32).out)


def test_R14_an_edge_whose_pages_are_all_unmapped_is_empty():
    sel, bt, cu, lens = _hand_index_inputs()
    bt = bt.copy()
    bt[0, 2:] = -1
    ix = psa.build_kvouter_index(sel, bt, cu, lens, block_size=4, page_size=2)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 3)).astype(f32)
    kc = rng.standard_normal((6, 2, 2, 3)).astype(f32)
    vc = rng.standard_normal((6, 2, 2, 3)).astype(f32)
    kc[2:4] = np.nan  # the pages that were unmapped
    pt = psa.forward_partials(q, kc, vc, ix, backend=BACKEND)
    empty = (ix.edge_seq == 0) & (ix.edge_block == 1)
    assert empty.sum() == 3
    assert np.isneginf(pt.m[empty]).all()
    assert (pt.l[empty] == 0).all() and (pt.o[empty] == 0).all()
    assert np.isfinite(pt.m[~empty]).all() and (pt.l[~empty] >= 1).all()


# --- R15: combine ---------------------------------------------------------------------------------

def test_R15_combine_by_hand():
    # one query, one KV head, G = 1, two edges: (m, l, o) = (1, 2, [2]) and (3, 1, [5])
    sel = np.array([[[0, 1]]])
    ix = psa.build_kvouter_index(sel, np.array([[0, 1]]), np.array([0, 1]), block_size=1, page_size=1)
    assert ix.edge_block.tolist() == [0, 1]
    pt = psa.Partials(o=np.array([[[2.0]], [[5.0]]], f32), m=np.array([[1.0], [3.0]], f32),
                      l=np.array([[2.0], [1.0]], f32))
    out, lse = psa.combine_partials(pt, ix)
    ll = math.exp(1 - 3) * 2 + 1
    assert out[0, 0, 0] == pytest.approx((math.exp(1 - 3) * 2 + 5) / ll, rel=tolerance(f32).out)
    assert lse[0, 0] == pytest.approx(3 + math.log(ll), rel=tolerance(f32).out)
    # both edges empty: out 0, lse -inf
    empty = psa.Partials(o=np.zeros((2, 1, 1), f32), m=np.full((2, 1), -np.inf, f32), l=np.zeros((2, 1), f32))
    out, lse = psa.combine_partials(empty, ix)
    assert out[0, 0, 0] == 0 and lse[0, 0] == -np.inf


@pytest.mark.parametrize("seed", range(4))
def test_R15_combine_of_forward_partials_equals_forward(seed):
    pb = random_problem(seed, seqlens_q=(3, 2), causal=bool(seed % 2), G=2)
    ix = pb.build_index()
    pt = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, ix, backend=BACKEND)
    out, lse = psa.combine_partials(pt, ix)
    out_f, lse_f = run(pb)
    assert_attention_close(out, out_f.astype(np.float64), dtype=f32, lse=lse, ref_lse=lse_f.astype(np.float64))


# --- R16: merge_states ---------------------------------------------------------------------------

def _states(seed, n=5, D=3):
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((n, D))
    lse = rng.standard_normal(n) * 3
    lse[0] = -np.inf
    o[0] = 0
    return o.astype(f32), lse.astype(f32)  # states as forward() returns them (R11)


def test_R16_merge_is_commutative_associative_with_identity():
    (oa, la), (ob, lb), (oc, lc) = _states(1), _states(2), _states(3)
    lb[1] = -np.inf
    ob[1] = 0
    o1, l1 = psa.merge_states(oa, la, ob, lb)
    o2, l2 = psa.merge_states(ob, lb, oa, la)
    np.testing.assert_array_equal(o1, o2)  # the formula is symmetric: same bits
    np.testing.assert_array_equal(l1, l2)
    left = psa.merge_states(*psa.merge_states(oa, la, ob, lb), oc, lc)
    right = psa.merge_states(oa, la, *psa.merge_states(ob, lb, oc, lc))
    eps = np.finfo(f32).eps  # each grouping rounds its intermediate state to float32 (R11)
    np.testing.assert_allclose(left[0], right[0], rtol=8 * eps, atol=8 * eps)
    np.testing.assert_allclose(left[1], right[1], rtol=8 * eps)
    zero, ninf = np.zeros_like(oa), np.full_like(la, -np.inf)
    oi, li = psa.merge_states(oa, la, zero, ninf)
    np.testing.assert_array_equal(oi, oa)
    np.testing.assert_array_equal(li, la)
    # both empty: stays empty, no NaN
    oe, le = psa.merge_states(zero, ninf, zero, ninf)
    assert (oe == 0).all() and np.isneginf(le).all()


def test_R16_merge_by_hand():
    o, lse = psa.merge_states(np.array([[1.0]]), np.array([math.log(2)]), np.array([[4.0]]), np.array([math.log(6)]))
    assert o[0, 0] == pytest.approx((2 * 1 + 6 * 4) / 8)
    assert lse[0] == pytest.approx(math.log(8))


@pytest.mark.parametrize("seed", range(4))
def test_R16_split_kv_then_merge_equals_whole(seed):
    pb = random_problem(seed, seqlens_q=(3, 2), msb=4, topk=4, fill=0.9, causal=bool(seed % 2))
    rng = np.random.default_rng(seed)
    half = rng.random(pb.selected.shape) < 0.5
    sel_a = np.where(half, pb.selected, -1)
    sel_b = np.where(half, -1, pb.selected)
    out, lse = run(pb)
    oa, la = run(pb.replace(selected=sel_a))
    ob, lb = run(pb.replace(selected=sel_b))
    om, lm = psa.merge_states(oa, la, ob, lb)
    assert_attention_close(om, out.astype(np.float64), dtype=f32, lse=lm, ref_lse=lse.astype(np.float64))


# --- R19 / R20 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_R19_same_bits_twice(seed):
    pb = random_problem(seed, seqlens_q=(4, 3), causal=True, dtype=np.float16 if seed == 2 else f32)
    a = run(pb)
    b = psa.forward(*(x.copy() for x in pb.args), **pb.options, backend=BACKEND, return_lse=True)
    assert a[0].tobytes() == b[0].tobytes()
    assert a[1].tobytes() == b[1].tobytes()


def test_R20_tolerances_come_from_the_dtype_and_can_fail():
    assert tolerance(np.float16).out > 100 * tolerance(np.float32).out
    assert tolerance(np.float32).out < 1e-5 < tolerance(np.float16).out < 1e-2
    ref = np.linspace(-3.0, 3.0, 12).reshape(2, 2, 3)
    assert_attention_close(ref.astype(f32), ref, dtype=f32)
    bumped = ref.copy()
    bumped[0, 0, 0] += 2 * tolerance(f32).out * 3.0
    with pytest.raises(AssertionError):
        assert_attention_close(bumped, ref, dtype=f32)
    assert_attention_close(bumped, ref, dtype=np.float16)  # within float16's budget
    with pytest.raises(AssertionError):
        assert_attention_close(np.where(ref > 0, np.nan, ref), ref, dtype=f32)
    with pytest.raises(AssertionError):  # -inf pattern must match
        assert_attention_close(ref, ref, dtype=f32, lse=np.array([0.0, -np.inf]), ref_lse=np.array([0.0, 1.0]))
