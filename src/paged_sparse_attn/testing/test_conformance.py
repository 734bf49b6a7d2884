"""The property suite: every rule of the contract, on every selected backend.

Run it on the built-in backends with ``pytest`` from the repository (``tests/test_properties.py``
re-exports these tests) or, for any backend, with::

    pytest --pyargs paged_sparse_attn.testing --backend NAME_OR_MODULE:FACTORY

Each test is named after the rule it checks. Problems come from
``paged_sparse_attn.testing.strategies`` within the backend's declared capabilities; expected
values come from [`dense_reference`][paged_sparse_attn.dense_reference] or from the independent formulas of
``paged_sparse_attn.testing.oracle``; tolerances from the dtype (R20).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the conformance suite needs hypothesis: pip install 'paged_sparse_attn[test]'") from exc

import paged_sparse_attn as psa
from paged_sparse_attn._validation import FLOAT_DTYPES
from paged_sparse_attn.index_branch import (
    block_scores,
    block_scores_reference,
    select_topk,
    select_topk_reference,
    sparse_attention,
)
from paged_sparse_attn.testing import oracle
from paged_sparse_attn.testing import strategies as pst
from paged_sparse_attn.testing.assertions import (
    assert_attention_close,
    assert_empty_rows_exact,
    assert_partials_close,
)
from paged_sparse_attn.testing.problem import AttentionProblem

SEEDS = st.integers(0, 2**32 - 1)


# --- helpers ---------------------------------------------------------------------------------

def _problem(data, backend, **kwargs) -> AttentionProblem:
    return data.draw(pst.problems(caps=backend.capabilities, **kwargs), label="problem")


@contextlib.contextmanager
def _no_backend_work(backend):
    """Fail if the backend is asked to compute anything inside the block (R17: reject first)."""
    def trap(name):
        def call(*args, **kwargs):
            raise AssertionError(f"backend.{name}() ran although the input is invalid: validation "
                                 "must reject it before any backend or device work (R17)")
        return call

    patched = []
    for name in ("forward", "forward_partials", "combine_partials", "block_scores", "select_topk"):
        try:
            setattr(backend, name, trap(name))
            patched.append(name)
        except (AttributeError, TypeError):  # e.g. __slots__: cannot spy, still check the error
            pass
    try:
        yield
    finally:
        for name in patched:
            delattr(backend, name)


def _split_selection(sel: np.ndarray, parts: int, seed: int) -> list[np.ndarray]:
    """Disjoint selections whose union is ``sel``: each kept id goes to one random part."""
    owner = np.random.default_rng(seed).integers(0, parts, size=sel.shape)
    return [np.where((owner == j) & (sel >= 0), sel, -1).astype(np.int32) for j in range(parts)]


def _rows_per_q_head(rows_kv: np.ndarray, G: int) -> np.ndarray:
    """[Tq, Hkv] -> [Tq, Hq]: query head hq reads KV head hq // G (R1)."""
    return np.repeat(rows_kv, G, axis=1)


# --- R9-R11, R20: agreement with the reference -----------------------------------------------

@given(data=st.data())
def test_R11_forward_matches_dense_reference(backend, data):
    p = _problem(data, backend)
    out, lse = p.forward(backend)
    assert out.dtype == np.float32 and lse.dtype == np.float32, f"R11: out {out.dtype}, lse {lse.dtype}"
    assert out.shape == p.q.shape and lse.shape == p.q.shape[:2], f"R11: out {out.shape}, lse {lse.shape}"
    ref, ref_lse = p.reference()
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, tol=p.tolerance(),
                           err_msg=f"[{backend.name}]")


@pytest.mark.psa_backends(exclude=("numpy",))
@given(data=st.data())
def test_R20_agrees_with_numpy_backend(backend, data):
    p = _problem(data, backend)
    out, lse = p.forward(backend)
    want, want_lse = p.forward("numpy")
    assert_attention_close(out, want, dtype=p.dtypes, lse=lse, ref_lse=want_lse,
                           tol=p.tolerance().times(2), err_msg=f"[{backend.name} vs numpy]")


@given(data=st.data())
def test_R19_same_inputs_same_result(backend, data):
    """Every backend: two runs agree to twice the R20 tolerance and both give the exact empty
    rows of R11. A backend that declares ``deterministic`` (numpy does): the same bits."""
    p = _problem(data, backend)
    (o1, l1), (o2, l2) = p.forward(backend), p.forward(backend)
    if backend.capabilities.deterministic:
        assert o1.tobytes() == o2.tobytes() and l1.tobytes() == l2.tobytes(), (
            f"[{backend.name}] R19: two runs gave different bits on a backend that declares deterministic")
    empty = _rows_per_q_head(~oracle.attended_mask(p).any(axis=-1), p.group_size)
    for o, l in ((o1, l1), (o2, l2)):
        assert_empty_rows_exact(o, l, np.where(empty, -np.inf, 0.0), err_msg=f"[{backend.name}] R19:")
    assert_attention_close(o2, o1, dtype=p.dtypes, lse=l2, ref_lse=l1, tol=p.tolerance().times(2),
                           err_msg=f"[{backend.name}] R19 second run vs first:")


# --- R27: batch invariance ----------------------------------------------------------------------

def _batch(p: AttentionProblem, order: list[int]) -> AttentionProblem:
    """The sequences ``order`` of ``p`` (repeats allowed), as one packed batch (R3)."""
    cu = p.cu_seqlens_q
    rows = [np.arange(cu[b], cu[b + 1]) for b in order]
    idx = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    counts = [int(cu[b + 1] - cu[b]) for b in order]
    return p.replace(q=p.q[idx], selected=p.selected[idx], block_tables=p.block_tables[order],
                     cu_seqlens_q=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                     used_kv_lens=None if p.used_kv_lens is None else p.used_kv_lens[order])


def _rows_of(p: AttentionProblem, order: list[int], at: int, res) -> tuple[np.ndarray, np.ndarray]:
    """The rows of the ``at``-th sequence of ``order`` in a result of ``_batch(p, order)``."""
    lo = sum(int(p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]) for b in order[:at])
    hi = lo + int(p.cu_seqlens_q[order[at] + 1] - p.cu_seqlens_q[order[at]])
    return res[0][lo:hi], res[1][lo:hi]


@given(data=st.data())
def test_R27_rows_do_not_depend_on_the_rest_of_the_batch(backend, data):
    """Binds backends that declare ``batch_invariant`` (numpy does): a sequence's rows give the
    same bits alone, in its batch, and in a shuffled and enlarged batch; with the index branch,
    its block scores and its selection too."""
    caps = backend.capabilities
    if not caps.batch_invariant:
        pytest.skip(f"backend {backend.name!r} does not declare batch_invariant (R27)")
    c = data.draw(pst.index_problems(caps=caps, num_seqs=st.integers(2, 4), max_queries=16), label="problem")
    p = c.problem
    with_queries = [x for x in range(p.num_seqs) if p.cu_seqlens_q[x + 1] > p.cu_seqlens_q[x]]
    b = data.draw(st.sampled_from(with_queries or [0]), label="sequence")
    others = [x for x in range(p.num_seqs) if x != b]
    shuffled = data.draw(st.permutations(others + others[:1] + [b]), label="shuffled, enlarged batch")
    batches = [[b], list(range(p.num_seqs)), list(shuffled)]
    got = []
    for order in batches:
        pb = _batch(p, order)
        rows = _rows_of(p, order, order.index(b), pb.forward(backend))
        if caps.index_branch:
            iq = np.concatenate([c.index_q[p.cu_seqlens_q[x]:p.cu_seqlens_q[x + 1]] for x in order])
            sc = block_scores(iq, c.index_k_cache, pb.block_tables, pb.cu_seqlens_q, pb.used_kv_lens,
                              block_size=p.block_size, causal=p.causal, backend=backend)
            sel = select_topk(sc, max(1, p.topk), cu_seqlens_q=pb.cu_seqlens_q, used_kv_lens=pb.used_kv_lens,
                              block_size=p.block_size, backend=backend)
            rows += _rows_of(p, order, order.index(b), (np.asarray(sc), np.asarray(sel)))
        got.append(rows)
    names = ("out", "lse", "block scores", "selection")
    for order, rows in zip(batches[1:], got[1:]):
        for name, x, alone in zip(names, rows, got[0]):
            assert x.tobytes() == alone.tobytes(), (
                f"[{backend.name}] R27: the {name} of sequence {b} alone differ from those in the batch {order}")


# --- invariances ------------------------------------------------------------------------------

@given(data=st.data())
def test_R2_permuting_physical_pages_changes_nothing(backend, data):
    p = _problem(data, backend)
    perm = np.array(data.draw(st.permutations(range(p.num_pages)), label="page permutation"))
    k, v = np.empty_like(p.k_cache), np.empty_like(p.v_cache)
    k[perm], v[perm] = p.k_cache, p.v_cache  # physical page j moves to perm[j]
    bt = np.where(p.block_tables >= 0, perm[np.maximum(p.block_tables, 0)], -1).astype(np.int32)
    out, lse = p.forward(backend, k_cache=k, v_cache=v, block_tables=bt)
    ref, ref_lse = p.reference()
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, tol=p.tolerance(),
                           err_msg=f"[{backend.name}]")


@given(data=st.data())
def test_R6_slot_order_and_padding_change_nothing(backend, data):
    p = _problem(data, backend)
    pad = data.draw(st.integers(0, 3), label="extra -1 slots")
    rng = np.random.default_rng(data.draw(SEEDS, label="slot seed"))
    Tq, Hkv, K = p.selected.shape
    sel = np.full((Tq, Hkv, K + pad), -1, dtype=np.int32)
    for t in range(Tq):
        for h in range(Hkv):
            sel[t, h, rng.permutation(K + pad)[:K]] = p.selected[t, h]
    out, lse = p.forward(backend, selected=sel)
    ref, ref_lse = p.reference()
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, tol=p.tolerance(),
                           err_msg=f"[{backend.name}]")


@given(data=st.data())
def test_R3_one_call_per_sequence_changes_nothing(backend, data):
    p = _problem(data, backend)
    outs, lses = [], []
    for b in range(p.num_seqs):
        lo, hi = int(p.cu_seqlens_q[b]), int(p.cu_seqlens_q[b + 1])
        o, l = p.forward(backend, q=p.q[lo:hi], selected=p.selected[lo:hi], block_tables=p.block_tables[b:b + 1],
                         cu_seqlens_q=np.array([0, hi - lo], dtype=np.int32),
                         used_kv_lens=None if p.used_kv_lens is None else p.used_kv_lens[b:b + 1])
        outs.append(o)
        lses.append(l)
    ref, ref_lse = p.reference()
    assert_attention_close(np.concatenate(outs), ref, dtype=p.dtypes, lse=np.concatenate(lses), ref_lse=ref_lse,
                           err_msg=f"[{backend.name}]")


@given(data=st.data())
def test_R8_scaling_q_equals_scaling_softmax_scale(backend, data):
    p = _problem(data, backend)
    c = data.draw(st.sampled_from([2.0, 0.5, -1.0, 4.0, 0.25, 0.0, 3.0]), label="c")
    q = (p.q.astype(np.float64) * c).astype(p.q.dtype)
    out, lse = p.forward(backend, q=q)  # softmax_scale unchanged
    ref, ref_lse = p.reference(softmax_scale=p.scale * c)
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, err_msg=f"[{backend.name}] c={c}")


# --- R10: never-read memory --------------------------------------------------------------------

@given(data=st.data())
def test_R10_unattended_memory_never_reaches_the_output(backend, data):
    """NaN/Inf in every cell no query attends (unmapped and spare pages, positions >= L_b,
    unselected blocks, causal future, tail pages) changes nothing; NaN/Inf in a cell some queries
    attend reaches only those queries."""
    p = _problem(data, backend)
    ref, ref_lse = p.reference()
    mask = oracle.attended_mask(p)  # [Tq, Hkv, npos]
    read = oracle.read_cells(p, mask)  # [P, Hkv, S]
    rng = np.random.default_rng(data.draw(SEEDS, label="poison seed"))
    frac = data.draw(st.sampled_from([0.0, 0.2, 0.6]), label="fraction of attended cells poisoned")
    hit = read & (rng.random(read.shape) < frac)
    bad = ~read | hit
    poisoned = p.copy()
    for cache in (poisoned.k_cache, poisoned.v_cache):
        cache[bad] = np.array([np.nan, np.inf, -np.inf])[rng.integers(0, 3, size=(int(bad.sum()), p.head_dim))]
    # rows (t, h) that attend a poisoned cell may be anything; all others must be untouched
    t, h, pos = np.nonzero(mask)
    touched = np.zeros(mask.shape[:2], dtype=bool)
    S = p.page_size
    np.logical_or.at(touched, (t, h), hit[p.block_tables[p.seq_of_query[t], pos // S], h, pos % S])
    clean = ~_rows_per_q_head(touched, p.group_size)
    out, lse = poisoned.forward(backend)
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, rows=clean,
                           err_msg=f"[{backend.name}] {int(bad.sum())} poisoned cells:")


# --- R11, R12: numerics -------------------------------------------------------------------------

@given(data=st.data())
def test_R12_extreme_logits_stay_exact(backend, data):
    """Integer data make every float32 score exact; logits around +-2^23 (offset regime) or far
    below any finite sentinel (scale up to 2^100) must give the exact softmax."""
    p = _problem(data, backend, values="integers", softmax_scale=st.just(1.0))
    regime = data.draw(st.sampled_from(["offset", "huge scale"]), label="regime")
    q, k = p.q.astype(np.float64), p.k_cache.astype(np.float64)
    rng = np.random.default_rng(data.draw(SEEDS, label="sign seed"))
    sign = data.draw(st.sampled_from(["-", "+", "mixed"]), label="sign")
    signs = {"-": -1.0, "+": 1.0}.get(sign) or rng.choice([-1.0, 1.0], size=q.shape[:2])
    if regime == "offset":
        # score = q0 * 1024 + (small integer terms): every position of a row shares the offset
        e = data.draw(st.sampled_from([10, 16, 20, 23]), label="log2 |offset|")
        k[..., 0] = 1024.0
        q[..., 0] = signs * 2.0 ** (e - 10)
        scale = 1.0
    else:
        e = data.draw(st.sampled_from([20, 60, 100]), label="log2 |scale|")
        scale = float(2.0 ** e) * (-1.0 if sign == "-" else 1.0)
    p = p.replace(q=q.astype(p.q.dtype), k_cache=k.astype(p.k_cache.dtype), softmax_scale=scale,
                  values=f"{p.values}, {regime} 2^{e}, sign {sign}")
    out, lse = p.forward(backend)
    ref, ref_lse = p.reference()
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, err_msg=f"[{backend.name}] {regime}:")


@given(data=st.data())
def test_R11_empty_rows_give_zero_and_minus_inf(backend, data):
    p = _problem(data, backend)
    empty = _rows_per_q_head(~oracle.attended_mask(p).any(axis=-1), p.group_size)
    out, lse = p.forward(backend)
    assert_empty_rows_exact(out, lse, np.where(empty, -np.inf, 0.0), err_msg=f"[{backend.name}]")
    assert np.isfinite(lse[~empty]).all(), f"[{backend.name}] R11: a row that attends something has lse = -inf"
    assert np.isfinite(out).all(), f"[{backend.name}] R11: out holds NaN/Inf"


# --- R14-R16: the algebra of partials and states ------------------------------------------------

@given(data=st.data())
def test_R14_partials_match_the_per_edge_formula(backend, data):
    p = _problem(data, backend)
    index = p.build_index()
    part = psa.forward_partials(p.q, p.k_cache, p.v_cache, index, softmax_scale=p.softmax_scale, backend=backend)
    E, G, D = index.num_edges, p.group_size, p.head_dim
    o, m, l = (np.asarray(x) for x in (part.o, part.m, part.l))
    assert o.shape == (E, G, D) and m.shape == (E, G) and l.shape == (E, G), (
        f"R14: o {o.shape}, m {m.shape}, l {l.shape}; want [E={E}, G={G}, D={D}]")
    assert o.dtype == m.dtype == l.dtype == np.float32, f"R14: partials must be float32, got {o.dtype}"
    ro, rm, rl = oracle.edge_partials(p, index)
    assert_partials_close(o, m, l, ro, rm, rl, dtype=p.dtypes, err_msg=f"[{backend.name}]")


@given(data=st.data())
def test_R15_combine_of_partials_equals_forward(backend, data):
    p = _problem(data, backend)
    index = p.build_index()
    part = psa.forward_partials(p.q, p.k_cache, p.v_cache, index, softmax_scale=p.softmax_scale, backend=backend)
    out, lse = psa.combine_partials(part, index)
    ref, ref_lse = p.reference()
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, err_msg=f"[{backend.name}] combine:")
    fwd, fwd_lse = p.forward(backend)
    assert_attention_close(out, fwd, dtype=p.dtypes, lse=lse, ref_lse=fwd_lse, tol=p.tolerance().times(2),
                           err_msg=f"[{backend.name}] combine vs forward:")


@given(data=st.data())
def test_R15_the_backends_own_combine_matches_the_reference(backend, data):
    """``backend.combine_partials`` itself, also when ``forward`` is overridden and never calls it."""
    p = _problem(data, backend)
    index = p.build_index()
    part = psa.forward_partials(p.q, p.k_cache, p.v_cache, index, softmax_scale=p.softmax_scale, backend=backend)
    out, lse = backend.combine_partials(part, index)
    out, lse = np.asarray(out), np.asarray(lse)
    assert out.dtype == lse.dtype == np.float32, f"R15: combine gave out {out.dtype}, lse {lse.dtype}"
    assert out.shape == p.q.shape and lse.shape == p.q.shape[:2], f"R15: out {out.shape}, lse {lse.shape}"
    ref, ref_lse = p.reference()
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse,
                           err_msg=f"[{backend.name}] its own combine_partials:")


def _states(p: AttentionProblem, backend, data, parts: int):
    sels = _split_selection(p.selected, parts, data.draw(SEEDS, label="split seed"))
    return [p.forward(backend, selected=s) for s in sels]


@given(data=st.data())
def test_R16_merge_states_is_commutative(backend, data):
    p = _problem(data, backend)
    (oa, la), (ob, lb) = _states(p, backend, data, 2)
    o1, l1 = psa.merge_states(oa, la, ob, lb)
    o2, l2 = psa.merge_states(ob, lb, oa, la)
    assert o1.tobytes() == o2.tobytes() and l1.tobytes() == l2.tobytes(), "R16: merge(a, b) != merge(b, a)"


@given(data=st.data())
def test_R16_merge_states_is_associative(backend, data):
    p = _problem(data, backend)
    (oa, la), (ob, lb), (oc, lc) = _states(p, backend, data, 3)
    left = psa.merge_states(*psa.merge_states(oa, la, ob, lb), oc, lc)
    right = psa.merge_states(oa, la, *psa.merge_states(ob, lb, oc, lc))
    assert_attention_close(left[0], right[0], dtype=p.dtypes, lse=left[1], ref_lse=right[1],
                           tol=p.tolerance().times(2), err_msg="R16 (a.b).c vs a.(b.c):")


@given(data=st.data())
def test_R16_merge_states_identity_is_zero_minus_inf(backend, data):
    p = _problem(data, backend)
    o, l = p.forward(backend)
    zero, ninf = np.zeros_like(o), np.full_like(l, -np.inf)
    for got in (psa.merge_states(o, l, zero, ninf), psa.merge_states(zero, ninf, o, l)):
        np.testing.assert_array_equal(got[0], o, err_msg="R16: merging with (0, -inf) changed o")
        np.testing.assert_array_equal(got[1], l, err_msg="R16: merging with (0, -inf) changed lse")


@given(data=st.data())
def test_R16_split_kv_merge_equals_whole(backend, data):
    p = _problem(data, backend)
    (oa, la), (ob, lb) = _states(p, backend, data, 2)
    out, lse = psa.merge_states(oa, la, ob, lb)
    ref, ref_lse = p.reference()
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse, tol=p.tolerance().times(2),
                           err_msg=f"[{backend.name}] split-KV:")


# --- R17, R18: errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("rule", pst.RULES)
@given(data=st.data())
def test_R17_single_violation_raises_spec_error_naming_the_rule(backend, rule, data):
    bad = data.draw(pst.invalid_problems(caps=backend.capabilities, rules=[rule]), label="invalid call")
    with _no_backend_work(backend), pytest.raises(psa.SpecError) as info:
        psa.forward(**bad.kwargs, backend=backend)
    err = info.value
    assert err.rule == rule, f"{bad.what}: expected a SpecError for {rule}, got {err.rule}: {err}"
    assert str(err).startswith("forward(): ") and str(err).endswith(f"[{rule}]"), f"message format: {err}"


@pytest.mark.parametrize("rule", pst.INDEX_RULES)
@given(data=st.data())
def test_R17_index_branch_violation_raises_spec_error_naming_the_rule(backend, rule, data):
    """Validation precedes the capability check, so this binds every backend, index branch or not."""
    bad = data.draw(pst.invalid_index_problems(caps=backend.capabilities, rules=[rule]), label="invalid call")
    with _no_backend_work(backend), pytest.raises(psa.SpecError) as info:
        sparse_attention(**bad.kwargs, backend=backend)
    err = info.value
    assert err.rule == rule, f"{bad.what}: expected a SpecError for {rule}, got {err.rule}: {err}"
    assert str(err).startswith("sparse_attention(): ") and str(err).endswith(f"[{rule}]"), f"message format: {err}"


def _minimal(dtype: str, D: int, S: int, BS: int) -> dict:
    dt = {d.name: d for d in FLOAT_DTYPES}[dtype]
    return dict(q=np.zeros((1, 1, D), dt), k_cache=np.zeros((1, 1, S, D), dt), v_cache=np.zeros((1, 1, S, D), dt),
                block_tables=np.zeros((1, BS // S), np.int32), selected=np.zeros((1, 1, 1), np.int32),
                cu_seqlens_q=np.array([0, 1], np.int32), block_size=BS)


@pytest.mark.parametrize("limit", ["dtype", "max_head_dim", "max_page_size", "max_block_size"])
def test_R18_problem_beyond_capabilities_raises_unsupported(backend, limit):
    caps = backend.capabilities
    dtype = caps.dtypes[0] if caps.dtypes else "float32"
    d = min(4, caps.max_head_dim or 4)
    if limit == "dtype":
        missing = [d.name for d in FLOAT_DTYPES if d.name not in caps.dtypes]
        if not missing:
            pytest.skip(f"backend {backend.name!r} runs every R7 dtype")
        kwargs = _minimal(missing[0], d, 1, 1)
    else:
        cap = getattr(caps, limit)
        if cap is None:
            pytest.skip(f"backend {backend.name!r} declares no {limit}")
        kwargs = {"max_head_dim": lambda: _minimal(dtype, cap + 1, 1, 1),
                  "max_page_size": lambda: _minimal(dtype, d, cap + 1, cap + 1),
                  "max_block_size": lambda: _minimal(dtype, d, 1, cap + 1)}[limit]()
    with _no_backend_work(backend), pytest.raises(psa.UnsupportedError) as info:
        psa.forward(**kwargs, backend=backend)
    assert backend.name in str(info.value), f"R18: the error must name the backend: {info.value}"


# --- R21-R25: the index branch, on backends that declare it ------------------------------------

def _index_case(data, backend, **kwargs) -> pst.IndexCase:
    if not backend.capabilities.index_branch:
        pytest.skip(f"backend {backend.name!r} does not declare the index branch (index_branch=False)")
    return data.draw(pst.index_problems(caps=backend.capabilities, **kwargs), label="index problem")


def _score_bound(c: pst.IndexCase, scale) -> np.ndarray:
    """R22: a float32 dot product of length d is within (d + 2) eps32 sum |iq| |ik| of the exact one."""
    p = c.problem
    mag = block_scores_reference(np.abs(c.index_q), np.abs(c.index_k_cache), *c.score_args()[2:],
                                 block_size=p.block_size, causal=p.causal,
                                 softmax_scale=None if scale is None else abs(scale))  # |beta|: a bound
    mag = np.abs(np.where(np.isfinite(mag), mag, 0.0))
    return (c.index_q.shape[2] + 2) * float(np.finfo(np.float32).eps) * mag + np.finfo(np.float32).tiny


@given(data=st.data())
def test_R22_block_scores_match_the_loop_reference(backend, data):
    c = _index_case(data, backend)
    p = c.problem
    scale = data.draw(st.sampled_from([None, 0.5, -1.0]), label="index softmax_scale")
    got = block_scores(*c.score_args(), block_size=p.block_size, causal=p.causal, softmax_scale=scale,
                       backend=backend)
    got = np.asarray(got)
    ref = block_scores_reference(*c.score_args(), block_size=p.block_size, causal=p.causal, softmax_scale=scale)
    assert got.dtype == np.float32 and got.shape == ref.shape, f"R22: got {got.dtype} {got.shape}"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref),
                                  err_msg=f"[{backend.name}] R22: -inf exactly where nothing is visible")
    fin = np.isfinite(ref)
    err = np.abs(got[fin].astype(np.float64) - ref[fin])
    bound = _score_bound(c, scale)[fin]
    assert (err <= bound).all(), (f"[{backend.name}] R22: a block score is off by {err.max():.4g}, "
                                  f"bound {bound[np.argmax(err - bound)]:.4g}")


@st.composite
def _scores(draw, shape):
    """float32 block scores with ties, NaN, -inf and +inf (R24 defines them all)."""
    pool = draw(st.sampled_from(["ties", "normal", "specials"]))
    rng = np.random.default_rng(draw(SEEDS))
    if pool == "ties":
        s = rng.integers(-2, 3, size=shape).astype(np.float32)
    else:
        s = rng.standard_normal(shape).astype(np.float32)
    if pool == "specials":
        s[rng.random(shape) < 0.3] = rng.choice(np.array([np.nan, -np.inf, np.inf, -0.0], np.float32))
    return s


@given(data=st.data())
def test_R24_select_topk_equals_the_reference_exactly(backend, data):
    c = _index_case(data, backend)
    p = c.problem
    scores = data.draw(_scores((p.num_queries, p.num_kv_heads, p.msb)), label="scores")
    force_local = data.draw(st.booleans(), label="force_local")
    topk = data.draw(st.integers(1 if force_local else 0, p.msb + 1), label="topk")
    kw = dict(force_local=force_local, cu_seqlens_q=p.cu_seqlens_q, used_kv_lens=p.used_kv_lens,
              block_size=p.block_size)
    got = np.asarray(select_topk(scores, topk, **kw, backend=backend))
    want = select_topk_reference(scores, topk, **kw)
    assert got.dtype == np.int32, f"R24: selection dtype {got.dtype}"
    np.testing.assert_array_equal(got, want, err_msg=f"[{backend.name}] R24: the selection is an exact "
                                                     "function of the float32 scores")


@given(data=st.data())
def test_R25_sparse_attention_is_its_three_steps(backend, data):
    c = _index_case(data, backend, topk=st.integers(1, 3))
    p = c.problem
    topk = max(1, p.topk)
    kw = dict(used_kv_lens=p.used_kv_lens, block_size=p.block_size)
    out, lse = sparse_attention(p.q, p.k_cache, p.v_cache, c.index_q, c.index_k_cache, p.block_tables,
                                p.cu_seqlens_q, **kw, topk=topk, causal=p.causal, softmax_scale=p.softmax_scale,
                                backend=backend, return_lse=True)
    scores = block_scores(*c.score_args(), block_size=p.block_size, causal=p.causal, backend=backend)
    sel = select_topk_reference(np.asarray(scores), topk, force_local=True, cu_seqlens_q=p.cu_seqlens_q, **kw)
    ref, ref_lse = p.reference(selected=sel)
    assert_attention_close(out, ref, dtype=p.dtypes, lse=lse, ref_lse=ref_lse,
                           err_msg=f"[{backend.name}] R25 sparse_attention vs the reference of its selection:")
    if backend.capabilities.deterministic:  # R19: the same bits as the three public calls
        want, want_lse = p.forward(backend, selected=sel)
        assert out.tobytes() == want.tobytes() and lse.tobytes() == want_lse.tobytes(), (
            f"[{backend.name}] R25: sparse_attention differs from its three steps on a deterministic backend")
