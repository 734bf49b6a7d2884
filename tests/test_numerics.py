"""Numerics of the spec: special values (R26), the derived tolerance (R20), query dtypes (R7),
the scale and the zero sizes (R1, R8), the combine and merge special cases (R15, R16).

Expected values are written as formulas of the rules, or computed by the float64 reference; each
test names the rule it checks. The R20 tests at D = 256 run on every selected backend.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends.numpy_backend import NumpyBackend
from paged_sparse_attn.index_branch import block_scores, select_topk, sparse_attention
from paged_sparse_attn.index_branch.reference import block_scores_reference
from paged_sparse_attn.testing import assert_attention_close, problem_tolerance, tolerance

f32 = np.float32
F32_MAX = float(np.finfo(f32).max)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "spec"


from paged_sparse_attn.testing.test_special_cases import *  # noqa: E402,F403  (the kit's R26 cases)
from paged_sparse_attn.testing.test_special_cases import one_page  # noqa: E402


def test_R26_block_score_logits_overflow_like_attention_scores():
    iq = np.ones((1, 1, 1), f32)
    ik = np.array([3.0, 1.0, -4.0, -3.0], f32).reshape(2, 1, 2, 1)
    args = (iq, ik, np.array([[0, 1]]), np.array([0, 1]))
    kw = dict(block_size=2, softmax_scale=2e38, causal=False)
    got = block_scores(*args, **kw, backend="numpy")
    ref = block_scores_reference(*args, **kw)
    # block 0: max(6e38 -> +inf, 2e38) = +inf; block 1: max(-8e38 -> -inf, -6e38 -> -inf) = -inf
    assert got.tolist() == [[[np.inf, -np.inf]]] and ref.tolist() == [[[np.inf, -np.inf]]]


# --- R15: the combine's special cases --------------------------------------------------------

def _two_edge_index():
    return psa.build_kvouter_index(np.array([[[0, 1]]]), np.array([[0, 1]]), np.array([0, 1]),
                                   block_size=2, page_size=2)


def test_R15_an_edge_with_minus_inf_m_is_skipped_whatever_its_l_and_o():
    index = _two_edge_index()
    o = np.array([[[np.nan, np.inf]], [[1.0, 2.0]]], f32)
    m = np.array([[-np.inf], [0.5]], f32)
    l = np.array([[np.nan], [2.0]], f32)
    out, lse = psa.combine_partials(psa.Partials(o, m, l), index)
    assert out.tolist() == [[[0.5, 1.0]]] and lse[0, 0] == f32(0.5 + math.log(2.0))


@pytest.mark.parametrize("bad_m", [np.nan, np.inf])
def test_R15_a_nan_or_plus_inf_maximum_makes_the_row_nan(bad_m):
    index = _two_edge_index()
    o = np.ones((2, 1, 2), f32)
    m = np.array([[bad_m], [0.5]], f32)
    l = np.ones((2, 1), f32)
    out, lse = psa.combine_partials(psa.Partials(o, m, l), index)
    assert np.isnan(out).all() and np.isnan(lse).all()


# --- R16: merge_states ------------------------------------------------------------------------

@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64])
def test_R16_merge_states_returns_float32_for_any_float_input(dt):
    o = np.array([[1.0, 2.0]], dt)
    lse = np.array([0.25], dt)
    mo, ml = psa.merge_states(o, lse, o * 3, lse)
    assert mo.dtype == np.float32 and ml.dtype == np.float32
    assert mo.tolist() == [[2.0, 4.0]] and ml[0] == f32(0.25 + math.log(2.0))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_R16_a_nan_or_plus_inf_lse_gives_nan_without_a_warning(bad):
    o = np.ones((2, 3), f32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mo, ml = psa.merge_states(o, np.array([bad, 0.0], f32), o, np.zeros(2, f32))
    assert np.isnan(mo[0]).all() and np.isnan(ml[0])
    assert mo[1].tolist() == [1.0, 1.0, 1.0] and ml[1] == f32(math.log(2.0))


def test_R16_the_empty_side_is_not_read():
    o_empty = np.array([[np.nan, np.inf]], f32)
    o, lse = np.array([[1.5, -2.0]], f32), np.array([0.75], f32)
    for args in ((o_empty, np.array([-np.inf], f32), o, lse), (o, lse, o_empty, np.array([-np.inf], f32))):
        mo, ml = psa.merge_states(*args)
        assert np.array_equal(mo, o) and np.array_equal(ml, lse)
    mo, ml = psa.merge_states(o_empty, np.array([-np.inf], f32), o_empty, np.array([-np.inf], f32))
    assert mo.tolist() == [[0.0, 0.0]] and np.isneginf(ml[0])


@pytest.mark.parametrize("shapes", [
    ((3, 4), (3,), (1, 4), (1,)),   # broadcastable rows
    ((3, 4), (1,), (3, 4), (3,)),   # broadcastable lse
    ((3, 4), (3,), (3, 1), (3,)),   # broadcastable D
    ((), (), (), ()),               # 0-d o has no D axis
])
def test_R16_shapes_must_match_exactly(shapes):
    arrays = [np.zeros(s, f32) for s in shapes]
    with pytest.raises(psa.SpecError, match=r"no broadcasting.*\[R16\]") as err:
        psa.merge_states(*arrays)
    assert err.value.rule == "R16"


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_R16_zero_sizes_give_empty_results(shape):
    o, lse = np.zeros(shape, f32), np.zeros(shape[:-1], f32)
    mo, ml = psa.merge_states(o, lse, o, lse)
    assert mo.shape == shape and ml.shape == shape[:-1] and mo.dtype == ml.dtype == np.float32


# --- R7: queries are widened to float32 before a backend sees them ----------------------------

class _SpyBackend(NumpyBackend):
    """The numpy backend, declaring float32 caches only and recording the q it receives."""

    name = "spy-float32"

    def __init__(self):
        self.seen = []

    @property
    def capabilities(self):
        return psa.Capabilities(dtypes=("float32",), index_branch=True)

    def forward_partials(self, problem, index):
        self.seen.append(problem.q)
        return super().forward_partials(problem, index)

    def block_scores(self, problem):
        self.seen.append(problem.index_q)
        return super().block_scores(problem)


def _query_dtypes():
    from paged_sparse_attn._validation import FLOAT_DTYPES

    return list(FLOAT_DTYPES)


@pytest.mark.parametrize("q_dt", _query_dtypes(), ids=lambda d: d.name)
def test_R7_a_backend_receives_every_query_dtype_as_exact_float32(q_dt):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2, 8)).astype(q_dt)
    k = rng.standard_normal((2, 1, 4, 8)).astype(f32)
    v = rng.standard_normal((2, 1, 4, 8)).astype(f32)
    args = (q, k, v, np.array([[0, 1]]), np.array([[[0, 1]], [[1, -1]]]), np.array([0, 2]))
    spy = _SpyBackend()
    out, lse = psa.forward(*args, block_size=4, backend=spy, return_lse=True)
    index = psa.build_kvouter_index(args[4], args[3], args[5], block_size=4, page_size=4)
    psa.forward_partials(q, k, v, index, backend=spy)
    iq = rng.standard_normal((2, 1, 8)).astype(q_dt)
    block_scores(iq, k, args[3], args[5], block_size=4, backend=spy)
    assert len(spy.seen) == 3
    for seen, given in zip(spy.seen, (q, q, iq)):
        assert seen.dtype == np.float32 and seen.flags.c_contiguous
        assert np.array_equal(seen, given.astype(np.float32))  # exact: same values
    ref, ref_lse = psa.dense_reference(*args, block_size=4)
    assert_attention_close(out, ref, dtype=f32, lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("q_dt,kv_dt", [(np.float16, np.float32), (np.float32, np.float16)])
def test_R7_query_and_cache_dtypes_may_differ(q_dt, kv_dt):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 2, 8)).astype(q_dt)
    k = rng.standard_normal((3, 1, 4, 8)).astype(kv_dt)
    v = rng.standard_normal((3, 1, 4, 8)).astype(kv_dt)
    args = (q, k, v, np.array([[2, 0, 1]]), np.array([[[0, 2]], [[1, -1]], [[2, 0]]]), np.array([0, 3]))
    out, lse = psa.forward(*args, block_size=4, causal=True, backend="numpy", return_lse=True)
    ref, ref_lse = psa.dense_reference(*args, block_size=4, causal=True)
    assert_attention_close(out, ref, dtype=(q_dt, kv_dt), lse=lse, ref_lse=ref_lse,
                           tol=problem_tolerance(*args, block_size=4, causal=True))


# --- R8: the scale and the causal defaults ----------------------------------------------------

@pytest.mark.parametrize("scale", [1e39, -1e39, np.float64(3.5e38), 10 ** 39])
def test_R8_a_scale_beyond_the_float32_range_is_refused(scale):
    args, kw = one_page([0.0, 1.0], [1.0, 2.0])
    with pytest.raises(psa.SpecError, match=r"softmax_scale must be finite in float32.*\[R8\]"):
        psa.forward(*args, **kw, softmax_scale=scale)
    with pytest.raises(psa.SpecError, match=r"\[R8\]"):
        block_scores(args[0], args[1], args[3], args[5], block_size=2, softmax_scale=scale)


@pytest.mark.parametrize("scale,as_float", [(2, 2.0), (np.int64(-3), -3.0), (np.float32(0.5), 0.5),
                                            (-0.25, -0.25), (F32_MAX, F32_MAX)])
def test_R8_ints_numpy_scalars_and_negative_scales_are_accepted(scale, as_float):
    rng = np.random.default_rng(5)
    args, kw = one_page(rng.standard_normal(4) * 1e-38 if as_float == F32_MAX else rng.standard_normal(4),
                        rng.standard_normal(4))
    got = psa.forward(*args, **kw, softmax_scale=scale, return_lse=True)
    want = psa.forward(*args, **kw, softmax_scale=as_float, return_lse=True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def _causal_matters():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 1, 4)).astype(f32)
    k = rng.standard_normal((1, 1, 4, 4)).astype(f32)
    v = rng.standard_normal((1, 1, 4, 4)).astype(f32)
    return q, k, v, np.array([[0]]), np.array([[[0]], [[0]]]), np.array([0, 2])


def test_R8_forward_defaults_to_causal_false():
    args = _causal_matters()
    default = psa.forward(*args, block_size=4)
    assert np.array_equal(default, psa.forward(*args, block_size=4, causal=False))
    assert not np.allclose(default, psa.forward(*args, block_size=4, causal=True))


def test_R8_block_scores_and_sparse_attention_default_to_causal_true():
    q, k, v, bt, _, cu = _causal_matters()
    iq, ik = q[:, :1], k.copy()
    ik[0, 0, 3] = 10 * iq[0, 0]  # position 3, in query 0's future, has its largest logit
    default = block_scores(iq, ik, bt, cu, block_size=4)
    assert np.array_equal(default, block_scores(iq, ik, bt, cu, block_size=4, causal=True))
    assert not np.array_equal(default, block_scores(iq, ik, bt, cu, block_size=4, causal=False))
    s = sparse_attention(q, k, v, iq, ik, bt, cu, block_size=4, topk=1)
    assert np.array_equal(s, sparse_attention(q, k, v, iq, ik, bt, cu, block_size=4, topk=1, causal=True))
    assert not np.allclose(s, sparse_attention(q, k, v, iq, ik, bt, cu, block_size=4, topk=1, causal=False))


# --- R1: sizes that may be zero and sizes that may not ----------------------------------------

def test_R1_zero_queries_zero_sequences_and_zero_pages_are_valid():
    k = np.zeros((2, 1, 4, 8), f32)
    # Tq = 0
    out, lse = psa.forward(np.zeros((0, 2, 8), f32), k, k, np.array([[0, 1]]), np.zeros((0, 1, 2), int),
                           np.array([0, 0]), block_size=4, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2) and out.dtype == lse.dtype == np.float32
    # B = 0 (and so Tq = 0)
    out = psa.forward(np.zeros((0, 2, 8), f32), k, k, np.zeros((0, 2), int), np.zeros((0, 1, 1), int),
                      np.array([0]), block_size=4)
    assert out.shape == (0, 2, 8)
    # P = 0: every page unmapped, every row empty
    empty = np.zeros((0, 1, 4, 8), f32)
    out, lse = psa.forward(np.ones((1, 2, 8), f32), empty, empty, np.array([[-1, -1]]), np.array([[[0, 1]]]),
                           np.array([0, 1]), block_size=4, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("q_shape,kv_shape", [
    ((1, 2, 0), (1, 1, 4, 0)),   # D = 0
    ((1, 2, 8), (1, 0, 4, 8)),   # Hkv = 0
    ((1, 2, 8), (1, 1, 0, 8)),   # S = 0
    ((1, 0, 8), (1, 1, 4, 8)),   # Hq = 0
])
def test_R1_zero_head_dim_heads_or_page_size_are_refused(q_shape, kv_shape):
    q, k = np.zeros(q_shape, f32), np.zeros(kv_shape, f32)
    with pytest.raises(psa.SpecError, match=r"\[R1\]"):
        psa.forward(q, k, k, np.array([[0]]), np.zeros((1, max(kv_shape[1], 1), 1), int), np.array([0, 1]),
                    block_size=4)


# --- R17: the example messages of the pages are the real ones ---------------------------------

def _page_messages(page: str) -> list[str]:
    text = (DOCS / page).read_text()
    blocks = re.findall(r"```text\n(.*?)```", text, flags=re.S)
    return [line for b in blocks for line in b.splitlines() if re.search(r"\[R\d+\]$", line)]


def _message(call) -> str:
    with pytest.raises(psa.SpecError) as err:
        call()
    return str(err.value)


def test_R17_the_example_messages_of_the_spec_pages_are_produced_verbatim():
    z = np.zeros
    q, k = z((4, 1, 8), f32), z((16, 1, 4, 8), f32)
    sel = np.full((4, 1, 3), -1)
    sel[3, 0, 2] = 9
    produced = {
        _message(lambda: psa.forward(q, k, k, np.arange(16).reshape(1, 16), sel, np.array([0, 4]), block_size=8)),
        _message(lambda: block_scores(z((1, 2, 8), f32), z((1, 3, 2, 8), f32), np.array([[0]]), np.array([0, 1]),
                                      block_size=2)),
        _message(lambda: select_topk(z((1, 1, 2), f32), 1)),
        _message(lambda: sparse_attention(z((3, 2, 8), f32), z((1, 2, 2, 8), f32), z((1, 2, 2, 8), f32),
                                          z((2, 2, 8), f32), z((1, 1, 2, 8), f32), np.array([[0]]),
                                          np.array([0, 3]), block_size=2, topk=1)),
    }
    documented = _page_messages("errors.md") + _page_messages("index-branch.md")
    assert len(documented) == 4
    assert set(documented) == produced


# --- R20: the derived tolerance ---------------------------------------------------------------

def test_R20_the_tolerance_grows_with_D_n_and_the_score_bound_and_follows_the_formula():
    u = 2.0 ** -24
    base = dict(head_dim=64, num_positions=64, score_bound=4.0, value_bound=2.0)
    t = tolerance(**base)
    assert t.out == pytest.approx(u * (4 * 65 * 4.0 + 4 * 64 + 18 * math.log(64) + 16))
    assert t.lse_abs == pytest.approx(u * (3 * 65 * 4.0 + 2 * 64 + 13 * math.log(64) + 8))
    assert t.out_limit(123.0) == t.out * 2.0  # relative to V, not to the reference
    for key, bigger in (("head_dim", 256), ("num_positions", 4096), ("score_bound", 10.0)):
        assert tolerance(**{**base, key: bigger}).out > t.out
    # the storage dtype does not enter the derived bound (16-bit data are exact in float32)
    assert tolerance(np.float16, **base) == t
    with pytest.raises(TypeError):
        tolerance(head_dim=8)
    twice = t.times(2)
    assert twice.out_limit(0.0) == 2 * t.out_limit(0.0) and twice.lse_limit(np.array([3.0])) == 2 * t.lse_limit(np.array([3.0]))


# --- zero sizes of the other public functions (the special-case lists of the numerics page) ---

def test_R14_no_edge_gives_partials_of_zero_edges():
    index = psa.build_kvouter_index(np.full((2, 1, 1), -1), np.array([[0]]), np.array([0, 2]),
                                    block_size=2, page_size=2)
    k = np.zeros((1, 1, 2, 4), f32)
    parts = psa.forward_partials(np.zeros((2, 3, 4), f32), k, k, index)
    assert parts.o.shape == (0, 3, 4) and parts.m.shape == parts.l.shape == (0, 3)
    out, lse = psa.combine_partials(parts, index)
    assert (out == 0).all() and np.isneginf(lse).all() and out.shape == (2, 3, 4)


def test_R22_zero_queries_give_an_empty_score_array():
    scores = block_scores(np.zeros((0, 2, 4), f32), np.zeros((1, 1, 2, 4), f32), np.zeros((0, 3), int),
                          np.array([0]), block_size=2)
    assert scores.shape == (0, 2, 3) and scores.dtype == np.float32


@pytest.mark.parametrize("Tq,topk", [(0, 2), (3, 0)])
def test_R24_zero_queries_or_zero_slots_give_an_empty_selection(Tq, topk):
    sel = select_topk(np.zeros((Tq, 2, 4), f32), topk, force_local=False)
    assert sel.shape == (Tq, 2, topk) and sel.dtype == np.int32
