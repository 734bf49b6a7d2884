"""The testing tools themselves: strategies stay valid and reach the edge cases, the mutation
catalogue breaks exactly the rule it names, the oracle agrees with the reference, and the
assertions fail when they should."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import paged_sparse_attn as psa
from paged_sparse_attn.testing import AttentionProblem, Tolerance, assert_attention_close, oracle, tolerance
from paged_sparse_attn.testing import strategies as pst
from paged_sparse_attn.testing.assertions import assert_empty_rows_exact, assert_partials_close
from paged_sparse_attn.testing.profiles import default_profile

# Searching for an edge case: no shrinking (we only need one), a fixed seed, no database.
SEARCH = settings(max_examples=400, phases=[Phase.generate], derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))


def _reaches(strategy, condition, what: str):
    try:
        return find(strategy, condition, settings=SEARCH)
    except Exception as exc:  # NoSuchExample
        raise AssertionError(f"the strategy never produced {what} in {SEARCH.max_examples} examples") from exc


# --- validity ------------------------------------------------------------------------------------

@given(p=pst.problems())
def test_problems_are_valid_for_the_library(p):
    out, lse = psa.forward(**p.kwargs(), backend="numpy", return_lse=True)  # validates R1-R8
    assert out.shape == p.q.shape and lse.shape == p.q.shape[:2]
    assert p.block_tables.dtype == p.selected.dtype == p.cu_seqlens_q.dtype == np.int32


@given(p=pst.problems(caps=psa.Capabilities(dtypes=("float16",), max_head_dim=3, max_page_size=2,
                                             max_block_size=4)))
def test_problems_stay_within_capabilities(p):
    assert p.dtypes == (np.dtype(np.float16), np.dtype(np.float16))
    assert p.head_dim <= 3 and p.page_size <= 2 and p.block_size <= 4


@given(cu=pst.cu_seqlens(num_seqs=st.integers(1, 5), queries_per_seq=st.integers(0, 6), max_queries=10))
def test_cu_seqlens_are_valid(cu):
    assert cu[0] == 0 and (np.diff(cu) >= 0).all() and cu[-1] <= 10 and cu.dtype == np.int32


@given(data=st.data(), B=st.integers(1, 3), pages=st.integers(1, 6), shared=st.booleans())
def test_block_tables_are_valid(data, B, pages, shared):
    table, P = data.draw(pst.block_tables(num_seqs=B, max_pages=pages, shared=shared))
    assert table.shape == (B, pages) and P >= 1
    assert ((table == -1) | ((table >= 0) & (table < P))).all()
    mapped = table[table >= 0]
    if not shared:
        assert len(set(mapped.tolist())) == mapped.size, "without sharing every page is mapped once"


@given(data=st.data(), B=st.integers(1, 4), cap=st.integers(0, 24), S=st.integers(1, 4))
def test_kv_lens_are_in_range(data, B, cap, S):
    lens = data.draw(pst.kv_lens(num_seqs=B, capacity=cap, page_size=S, block_size=2 * S))
    assert lens.shape == (B,) and ((lens >= 0) & (lens <= cap)).all()


@given(data=st.data(), Tq=st.integers(0, 5), Hkv=st.integers(1, 3), topk=st.integers(0, 5), msb=st.integers(1, 4))
def test_selections_are_valid(data, Tq, Hkv, topk, msb):
    sel = data.draw(pst.selections(num_queries=Tq, num_kv_heads=Hkv, topk=topk, num_blocks=msb))
    assert sel.shape == (Tq, Hkv, topk) and ((sel >= -1) & (sel < msb)).all()
    for row in sel.reshape(Tq * Hkv, topk):
        ids = row[row >= 0]
        assert len(set(ids.tolist())) == ids.size, f"repeated id in {row}"


@given(data=st.data(), Tq=st.integers(0, 5), topk=st.integers(3, 5), msb=st.integers(1, 3))
def test_selections_all_blocks_selects_every_block(data, Tq, topk, msb):
    Hkv = 2
    sel = data.draw(pst.selections(num_queries=Tq, num_kv_heads=Hkv, topk=topk, num_blocks=msb, all_blocks=True))
    for row in sel.reshape(Tq * Hkv, topk):
        assert sorted(row[row >= 0].tolist()) == list(range(msb))


# --- edge cases are reached ---------------------------------------------------------------------

def _empty_and_nonempty_rows(p):
    rows = oracle.attended_mask(p).any(axis=-1)
    return (~rows).any() and rows.any()


EDGE_CASES = {
    "a row that attends nothing next to one that attends something": _empty_and_nonempty_rows,
    "a selection row of only -1": lambda p: ((p.selected < 0).all(axis=-1)).any() and p.topk > 0,
    "an unmapped (-1) page": lambda p: (p.block_tables < 0).any(),
    "a physical page no sequence maps (spare)": lambda p: len(set(p.block_tables[p.block_tables >= 0].tolist()))
    < p.num_pages,
    "a physical page mapped twice (shared)": lambda p: len(set(p.block_tables[p.block_tables >= 0].tolist()))
    < int((p.block_tables >= 0).sum()),
    "block table columns past msb * ppb": lambda p: p.block_tables.shape[1] > p.msb * p.pages_per_block,
    "causal with T_b > L_b": lambda p: p.causal and (np.diff(p.cu_seqlens_q) > p.kv_lens).any(),
    "causal cutting a selected block": lambda p: p.causal and (oracle.attended_mask(p) != oracle.attended_mask(
        p.replace(causal=False))).any(),
    "G = 1": lambda p: p.group_size == 1,
    "G > 4": lambda p: p.group_size > 4,
    "Hkv > 1": lambda p: p.num_kv_heads > 1,
    "an empty sequence (T_b = 0) among others": lambda p: (np.diff(p.cu_seqlens_q) == 0).any() and p.num_queries > 0,
    "L_b = 0": lambda p: (p.kv_lens == 0).any(),
    "L_b = msb * block_size (full)": lambda p: (p.kv_lens == p.msb * p.block_size).any(),
    "L_b not a multiple of the page size": lambda p: (p.kv_lens % p.page_size != 0).any(),
    "L_b a multiple of the page size but not of the block size": lambda p: (
        (p.kv_lens % p.page_size == 0) & (p.kv_lens % p.block_size != 0)).any(),
    "used_kv_lens=None (the R4 default)": lambda p: p.used_kv_lens is None,
    "a row selecting every block": lambda p: p.topk >= p.msb > 1 and (
        (p.selected >= 0).sum(axis=-1) == p.msb).any(),
    "-1 padding before a valid id": lambda p: p.topk > 1 and ((p.selected[..., :-1] < 0)
                                                              & (p.selected[..., 1:] >= 0)).any(),
    "topk = 0": lambda p: p.topk == 0,
    "Tq = 0": lambda p: p.num_queries == 0,
    "float16 caches with float32 queries": lambda p: p.dtypes == (np.dtype(np.float32), np.dtype(np.float16)),
    "head_dim not a multiple of 4": lambda p: p.head_dim % 4 != 0,
    "block_size > page_size": lambda p: p.block_size > p.page_size,
}


@pytest.mark.parametrize("what", list(EDGE_CASES))
def test_problems_reach_edge_case(what):
    _reaches(pst.problems(), EDGE_CASES[what], what)


def test_problems_are_mostly_not_degenerate():
    """In a fixed sample most problems attend something and many have empty rows next to full ones."""
    seen = {"n": 0, "attends": 0, "mixed": 0}

    @settings(max_examples=150, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(p=pst.problems())
    def sample(p):
        seen["n"] += 1
        seen["attends"] += bool(oracle.attended_mask(p).any())
        seen["mixed"] += bool(_empty_and_nonempty_rows(p))

    sample()
    assert seen["attends"] >= 0.6 * seen["n"], seen
    assert seen["mixed"] >= 0.25 * seen["n"], seen


# --- invalid problems -----------------------------------------------------------------------------

@pytest.mark.parametrize("rule", pst.RULES)
@given(data=st.data())
def test_invalid_problems_break_the_tagged_rule(rule, data):
    bad = data.draw(pst.invalid_problems(rules=[rule]))
    assert bad.rule == rule
    with pytest.raises(psa.SpecError) as info:
        psa.dense_reference(**bad.kwargs)
    assert info.value.rule == rule, f"{bad.what}: got {info.value}"


def _mutation_id(m) -> str:
    return m.__name__.strip("_")


@pytest.mark.parametrize("rule, mutate", [(r, m) for r, ms in pst.MUTATIONS.items() for m in ms],
                         ids=[_mutation_id(m) for ms in pst.MUTATIONS.values() for m in ms])
def test_every_mutation_applies_somewhere_and_breaks_its_rule(rule, mutate):
    rnd = random.Random(0)
    pick = lambda lo, hi: rnd.randint(lo, hi)  # noqa: E731
    base = _reaches(pst.problems(max_queries=6), lambda p: mutate(p, lambda lo, hi: lo) is not None,
                    f"a problem that {mutate.__name__} applies to")
    for _ in range(5):  # a few random choices inside the mutation
        got = mutate(base, pick)
        if got is None:
            continue
        changes, what = got
        kwargs = base.kwargs()
        kwargs.update(changes)
        with pytest.raises(psa.SpecError) as info:
            psa.forward(**kwargs, backend="numpy")
        assert info.value.rule == rule, f"{what}: expected {rule}, got {info.value}"


# --- the oracle -------------------------------------------------------------------------------------

@given(p=pst.problems())
def test_oracle_attention_equals_dense_reference(p):
    out, lse = oracle.masked_attention(p)
    ref, ref_lse = psa.dense_reference(**p.kwargs())
    assert_attention_close(out, ref, dtype=np.float64, lse=lse, ref_lse=ref_lse,
                           tol=Tolerance(1e-12, 1e-12), err_msg="oracle vs dense_reference")


@given(p=pst.problems())
def test_oracle_partials_combine_to_oracle_attention(p):
    index = p.build_index()
    o, m, l = oracle.edge_partials(p, index)
    out, lse = psa.combine_partials(psa.Partials(o, m, l), index)
    ref, ref_lse = oracle.masked_attention(p)
    assert_attention_close(out, ref, dtype=np.float32, lse=lse, ref_lse=ref_lse, err_msg="combined oracle partials")


# --- the assertions ---------------------------------------------------------------------------------

def test_tolerance_is_derived_from_the_dtype():
    f32, f16 = tolerance(np.float32).out, tolerance(np.float16).out
    assert f32 == 64 * np.finfo(np.float32).eps and f16 == 8 * np.finfo(np.float16).eps
    assert tolerance(np.float32, np.float16).out == f16  # the least precise dtype wins
    assert tolerance(np.float64).out == f32  # never below float32: backends accumulate in float32


def test_assert_attention_close_accepts_errors_within_and_rejects_errors_beyond_the_tolerance():
    ref = np.random.default_rng(0).standard_normal((3, 2, 4))
    tol = tolerance(np.float32).out
    assert_attention_close(ref + 0.5 * tol, ref, dtype=np.float32)
    with pytest.raises(AssertionError, match="max \\|out - ref\\|"):
        assert_attention_close(ref + 4 * tol * max(1, np.abs(ref).max()), ref, dtype=np.float32)
    with pytest.raises(AssertionError, match="not finite"):
        bad = ref.copy()
        bad[1, 1, 2] = np.nan
        assert_attention_close(bad, ref, dtype=np.float32)


def test_assert_attention_close_checks_empty_rows_exactly():
    ref = np.zeros((2, 1, 3))
    ref_lse = np.array([[-np.inf], [0.5]])
    ref[1] = 1.0
    out = ref.copy()
    out[0, 0, 0] = 1e-30  # tiny, within any tolerance, but an empty row must be exactly 0
    with pytest.raises(AssertionError, match="attends nothing"):
        assert_attention_close(out, ref, dtype=np.float32, lse=ref_lse, ref_lse=ref_lse)
    with pytest.raises(AssertionError, match="-inf"):
        assert_attention_close(ref, ref, dtype=np.float32, lse=np.array([[-1e30], [0.5]]), ref_lse=ref_lse)
    assert_empty_rows_exact(ref, ref_lse, ref_lse)


def test_assert_partials_close_requires_exact_empty_edges():
    ro, rm, rl = np.zeros((1, 1, 2)), np.array([[-np.inf]]), np.zeros((1, 1))
    assert_partials_close(ro, rm, rl, ro, rm, rl, dtype=np.float32)
    with pytest.raises(AssertionError, match="m = -inf"):
        assert_partials_close(ro, np.array([[-1e30]]), rl, ro, rm, rl, dtype=np.float32)


# --- packaging ------------------------------------------------------------------------------------

def test_importing_the_package_imports_neither_hypothesis_nor_pytest():
    code = ("import sys, paged_sparse_attn, paged_sparse_attn.testing; "
            "bad = [m for m in ('hypothesis', 'pytest', 'wgpu') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ci_profile_is_chosen_when_CI_is_true(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert default_profile() == "ci"
    monkeypatch.setenv("CI", "")
    assert default_profile() == "dev"


def test_attention_problem_repr_is_enough_to_rebuild_the_index_arrays():
    p = find(pst.problems(), lambda p: p.num_queries > 1, settings=SEARCH)
    text = repr(p)
    for name in ("cu_seqlens_q", "used_kv_lens", "block_tables", "selected", "values="):
        assert name in text
    assert isinstance(p, AttentionProblem)
