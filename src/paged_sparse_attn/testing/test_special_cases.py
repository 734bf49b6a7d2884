"""The conformance kit's special cases of R26 (and R11's empty rows): exact results for infinite,
NaN and overflowing scores and values, on every selected backend; and R20 at D = 256 over
thousands of positions, within the tolerance derived on the numerics page.

Small hand-made problems (one query, one head, a few positions) whose results the spec fixes
exactly; collected with the rest of the kit (``pytest --pyargs paged_sparse_attn.testing
--backend NAME``) and, for the project's own run, through ``tests/test_numerics.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.testing.assertions import assert_attention_close, problem_tolerance

f32 = np.float32


def one_page(keys, values, *, q=1.0):
    """One query, one head, D = 1, one page holding ``len(keys)`` positions, all selected."""
    n = len(keys)
    k = np.asarray(keys, f32).reshape(1, 1, n, 1)
    v = np.asarray(values, f32).reshape(1, 1, n, 1)
    qq = np.full((1, 1, 1), q, f32)
    return (qq, k, v, np.array([[0]]), np.array([[[0]]]), np.array([0, 1])), dict(block_size=n)


def all_three(args, kw, backend="numpy", **extra):
    """(forward, dense_reference, forward_partials) of ``backend``, each as arrays."""
    out, lse = psa.forward(*args, **kw, **extra, backend=backend, return_lse=True)
    ref, ref_lse = psa.dense_reference(*args, **kw, **extra)
    index = psa.build_kvouter_index(args[4], args[3], args[5], block_size=kw["block_size"],
                                    page_size=args[1].shape[2])
    parts = psa.forward_partials(args[0], args[1], args[2], index, backend=backend, **extra)
    return (out, lse), (ref, ref_lse), parts


# --- R26: overflow, infinities and NaN in attended data --------------------------------------

def test_R26_scores_beyond_the_float32_range_are_infinite_in_backend_and_reference(backend):
    # scale 1e38, keys -4 and 1: scores -4e38 (beyond float32: -inf, removed with its NaN value)
    # and 1e38 (finite): the result is the second position alone
    args, kw = one_page([-4.0, 1.0], [np.nan, 2.0])
    (out, lse), (ref, ref_lse), parts = all_three(args, kw, backend, softmax_scale=1e38)
    assert out[0, 0, 0] == 2.0 and ref[0, 0, 0] == 2.0
    assert lse[0, 0] == f32(1e38) and ref_lse[0, 0] == pytest.approx(1e38, rel=1e-7)
    assert parts.m[0, 0] == f32(1e38) and parts.l[0, 0] == 1.0 and parts.o[0, 0, 0] == 2.0


def test_R26_a_row_whose_scores_all_overflow_to_minus_inf_is_empty(backend):
    args, kw = one_page([3.0, 2.0], [np.nan, 2.0])  # scores -6e38 and -4e38: both -inf
    (out, lse), (ref, ref_lse), parts = all_three(args, kw, backend, softmax_scale=-2e38)
    for o, l in ((out, lse), (ref, ref_lse)):
        assert o[0, 0, 0] == 0 and np.isneginf(l[0, 0])  # as for an empty set (R11)
    assert np.isneginf(parts.m[0, 0]) and parts.l[0, 0] == 0 and parts.o[0, 0, 0] == 0


@pytest.mark.parametrize("case", ["nan_key", "inf_key", "overflow_up", "inf_query", "nan_query"])
def test_R26_a_nan_or_plus_inf_score_makes_the_row_nan(case, backend):
    keys, q, scale = [0.5, 1.0], 1.0, 1.0
    if case == "nan_key":
        keys = [np.nan, 1.0]
    elif case == "inf_key":
        keys = [np.inf, 1.0]
    elif case == "overflow_up":
        scale = 2e38  # score 2e38 * 1.0 fits, 2e38 * 2.0 overflows to +inf
        keys = [2.0, 1.0]
    elif case == "inf_query":
        q = np.inf
    else:
        q = np.nan
    args, kw = one_page(keys, [1.0, 2.0], q=q)
    (out, lse), (ref, ref_lse), parts = all_three(args, kw, backend, softmax_scale=scale)
    for o, l in ((out, lse), (ref, ref_lse)):
        assert np.isnan(o).all() and np.isnan(l).all()
    assert np.isnan(parts.l).all() and np.isnan(parts.o).all()
    if case in ("nan_key", "nan_query"):
        assert np.isnan(parts.m).all()
    else:
        assert (parts.m == np.inf).all()  # a +inf score and no NaN one (R14)


def test_R26_scale_zero_does_not_hide_an_infinite_query(backend):
    args, kw = one_page([0.5, 1.0], [1.0, 2.0], q=np.inf)
    (out, lse), (ref, ref_lse), _ = all_three(args, kw, backend, softmax_scale=0.0)
    assert np.isnan(out).all() and np.isnan(lse).all() and np.isnan(ref).all() and np.isnan(ref_lse).all()


def _two_blocks(v_first, keys, *, block_size):
    """One query, D = 1, positions 0..3 on pages of 2; v of position 0 is ``v_first``."""
    k = np.asarray(keys, f32).reshape(2, 1, 2, 1)
    v = np.array([v_first, 1.0, 2.0, 3.0], f32).reshape(2, 1, 2, 1)
    msb = 4 // block_size
    sel = np.arange(msb).reshape(1, 1, msb)
    return (np.ones((1, 1, 1), f32), k, v, np.array([[0, 1]]), sel, np.array([0, 1])), dict(block_size=block_size)


@pytest.mark.parametrize("block_size", [2, 4])  # position 0 in its own edge, or with the others
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_R26_a_minus_inf_score_removes_its_value_whatever_the_edges(block_size, poison, backend):
    keys = [-np.inf, 0.0, 1.0, 2.0]
    args, kw = _two_blocks(poison, keys, block_size=block_size)
    (out, lse), (ref, ref_lse), _ = all_three(args, kw, backend, softmax_scale=1.0)
    w = np.exp(np.array([0.0, 1.0, 2.0]))
    want = float(w @ np.array([1.0, 2.0, 3.0]) / w.sum())
    assert out[0, 0, 0] == pytest.approx(want, rel=1e-6) and ref[0, 0, 0] == pytest.approx(want, rel=1e-12)
    assert lse[0, 0] == pytest.approx(math.log(w.sum()), rel=1e-6)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_R26_a_non_finite_attended_value_reaches_only_its_component(poison, backend):
    rng = np.random.default_rng(7)
    D = 4
    q = rng.standard_normal((2, 2, D)).astype(f32)
    k = rng.standard_normal((2, 1, 4, D)).astype(f32)
    v = rng.standard_normal((2, 1, 4, D)).astype(f32)
    v[1, 0, 2, 1] = poison  # position 6, component 1
    args = (q, k, v, np.array([[0, 1]]), np.array([[[0, 1]], [[1, -1]]]), np.array([0, 2]))
    kw = dict(block_size=4)
    out, lse = psa.forward(*args, **kw, backend=backend, return_lse=True)
    ref, ref_lse = psa.dense_reference(*args, **kw)
    bad = np.zeros(out.shape, bool)
    bad[:, :, 1] = True  # every row attends position 6
    assert not np.isfinite(out[bad]).any() and not np.isfinite(ref[bad]).any()
    clean = np.where(bad, 0.0, ref)
    assert_attention_close(np.where(bad, 0, out), clean, dtype=f32, lse=lse, ref_lse=ref_lse)


# --- R20: large D and long reductions within the derived bound ---------------------------------

def _long_problem(seed, *, D, Tq_per_seq, num_seqs, topk, block_size, page_size, causal, kv_dtype):
    """Caches with ``topk * block_size`` positions per sequence, each query selecting every block."""
    rng = np.random.default_rng(seed)
    ppb = block_size // page_size
    pages_per_seq = topk * ppb
    P = num_seqs * pages_per_seq
    bt = rng.permutation(P).reshape(num_seqs, pages_per_seq)  # scrambled physical pages (R2)
    Tq = Tq_per_seq * num_seqs
    q = rng.standard_normal((Tq, 2, D)).astype(f32)
    k = rng.standard_normal((P, 1, page_size, D)).astype(kv_dtype)
    v = rng.standard_normal((P, 1, page_size, D)).astype(kv_dtype)
    sel = np.stack([rng.permutation(topk) for _ in range(Tq)]).reshape(Tq, 1, topk)
    cu = np.arange(num_seqs + 1) * Tq_per_seq
    return (q, k, v, bt, sel, cu), dict(block_size=block_size, causal=causal)


@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_R20_D256_and_thousands_of_positions_stay_within_the_derived_bound(backend, shape):
    caps = backend.capabilities
    if caps.max_head_dim is not None and caps.max_head_dim < 256:
        pytest.skip(f"backend {backend.name!r} declares max_head_dim={caps.max_head_dim} < 256")
    kv_dtype = np.float16 if "float16" in caps.dtypes else f32
    if shape == "decode":  # two sequences, one query each, 4096 positions
        args, kw = _long_problem(11, D=256, Tq_per_seq=1, num_seqs=2, topk=16, block_size=256, page_size=16,
                                 causal=False, kv_dtype=kv_dtype)
    else:  # one chunk of 8 queries, causal, 2048 positions
        args, kw = _long_problem(12, D=256, Tq_per_seq=8, num_seqs=1, topk=16, block_size=128, page_size=32,
                                 causal=True, kv_dtype=f32)
    out, lse = psa.forward(*args, **kw, backend=backend, return_lse=True)
    ref, ref_lse = psa.dense_reference(*args, **kw)
    tol = problem_tolerance(*args, **kw)
    assert_attention_close(out, ref, dtype=(args[0].dtype, args[1].dtype), lse=lse, ref_lse=ref_lse, tol=tol,
                           err_msg=f"[{backend.name}, {shape}]")
    # the bound can fail: one output moved by twice its limit is refused
    bumped = out.copy()
    bumped[0, 0, 0] += 2 * tol.out_limit(0.0)
    with pytest.raises(AssertionError, match="R20"):
        assert_attention_close(bumped, ref, dtype=f32, tol=tol)
