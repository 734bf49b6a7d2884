"""The problem generators (``paged_sparse_attn.testing.generate``) make what they say they make:
the tests, the demo and the benchmarks rely on these properties."""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.testing import oracle
from paged_sparse_attn.testing.generate import (
    local_topk_selection,
    msa_problem,
    page_tables,
    random_problem,
    random_selection,
)


@pytest.mark.parametrize("seed", range(6))
def test_page_tables_scramble_pages_with_holes_shares_and_spares_R2(seed):
    rng = np.random.default_rng(seed)
    mapped = [7, 0, 12, 5]
    bt, P, holes = page_tables(rng, mapped, 12, hole_prob=0.3, share_prob=0.2 if seed % 2 else 0.0, spare_pages=3)
    assert bt.shape == (4, 12) and bt.dtype == np.int32
    for b, n in enumerate(mapped):
        assert (bt[b, n:] == -1).all()  # past the mapped pages: unmapped
    assert holes == sum(int((bt[b, :n] < 0).sum()) for b, n in enumerate(mapped))
    used = bt[bt >= 0]
    assert used.min() >= 0 and used.max() < P
    assert P - len(np.unique(used)) == 3  # the spare pages: mapped by no sequence
    if seed % 2 == 0:
        assert len(np.unique(used)) == len(used)  # no sharing asked: no page mapped twice


def test_page_tables_without_holes_are_a_permutation():
    bt, P, holes = page_tables(np.random.default_rng(0), [6, 6], 6)
    assert holes == 0 and P == 12
    assert sorted(bt.ravel().tolist()) == list(range(12)) and not np.array_equal(bt.ravel(), np.arange(12))


def test_random_selection_rows_are_valid_and_padded_R6():
    sel = random_selection(np.random.default_rng(1), 40, 3, msb=5, topk=7, fill=0.6)
    assert sel.shape == (40, 3, 7)
    for row in sel.reshape(-1, 7):
        ids = row[row >= 0]
        assert len(set(ids.tolist())) == len(ids) and (ids < 5).all()
    assert (sel < 0).any() and ((sel[..., :-1] < 0) & (sel[..., 1:] >= 0)).any()  # padding before an id


@pytest.mark.parametrize("shuffle", [False, True])
def test_local_topk_selection_keeps_the_local_block_R9_R24(shuffle):
    rng = np.random.default_rng(0)
    cu, lens = np.array([0, 1, 6, 9]), np.array([100, 64, 2])
    sel = local_topk_selection(rng, cu, lens, num_kv_heads=2, msb=4, block_size=32, topk=3, shuffle_slots=shuffle)
    assert sel.shape == (9, 2, 3) and sel.dtype == np.int32
    for b in range(3):
        T = cu[b + 1] - cu[b]
        for i in range(T):
            last = lens[b] - T + i
            row = sel[cu[b] + i]
            if last < 0:
                assert (row == -1).all()  # the query sees nothing
                continue
            for h in range(2):
                ids = row[h][row[h] >= 0]
                assert last // 32 in ids and (ids <= last // 32).all()
                assert len(set(ids.tolist())) == len(ids) == min(3, last // 32 + 1)
                if not shuffle:
                    assert row[h][0] == last // 32  # slot 0, as select_topk(force_local=True)


def test_local_topk_selection_without_causal_uses_the_last_block():
    sel = local_topk_selection(np.random.default_rng(3), [0, 4], [70], num_kv_heads=1, msb=3, block_size=32,
                               topk=2, causal=False)
    assert (sel[:, 0, 0] == 2).all() and (sel[:, 0, 1] >= 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_random_problem_poisons_exactly_the_unread_cells_R10(seed):
    pb = random_problem(seed, seqlens_q=(3, 1, 0), causal=bool(seed % 2), share_prob=0.3)
    read = oracle.read_cells(pb)
    bad = ~np.isfinite(pb.k_cache).all(axis=-1)
    assert pb.poisoned_cells == int((~read).sum()) > 0
    np.testing.assert_array_equal(bad, ~read)
    clean = random_problem(seed, seqlens_q=(3, 1, 0), causal=bool(seed % 2), share_prob=0.3, poison=False)
    assert clean.poisoned_cells == 0 and np.isfinite(clean.k_cache).all()
    np.testing.assert_array_equal(clean.k_cache[read], pb.k_cache[read])  # same draws, only unread cells differ


def test_random_problem_is_seeded_and_valid():
    a, b, c = random_problem(5), random_problem(5), random_problem(6)
    for name in ("q", "k_cache", "block_tables", "selected", "cu_seqlens_q", "used_kv_lens"):
        assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True)
    assert not np.array_equal(a.q, c.q)
    out, lse = a.forward("numpy")
    assert out.shape == a.q.shape and np.isfinite(out).all()
    assert random_problem(1, used="default").used_kv_lens is None  # the R4 default


@pytest.mark.parametrize("T,fill", [(1, "all"), (5, "selected")])
def test_msa_problem_geometry(T, fill):
    p = msa_problem(B=3, L=200, Tq_per_seq=T, Hq=4, Hkv=2, D=8, page_size=4, block_size=16, topk=4,
                    dtype="float16", seed=2, fill=fill)
    msb = -(-200 // 16)
    assert p.q.shape == (3 * T, 4, 8) and p.q.dtype == np.float32 and p.k_cache.dtype == np.float16
    assert p.block_tables.shape == (3, msb * 4) and p.num_pages == 3 * msb * 4
    assert sorted(p.block_tables.ravel().tolist()) == list(range(p.num_pages))  # every page mapped once
    assert p.used_kv_lens.tolist() == [200] * 3 and p.cu_seqlens_q.tolist() == [0, T, 2 * T, 3 * T]
    local = (200 - T + np.tile(np.arange(T), 3)) // 16
    assert (p.selected[:, :, 0] == local[:, None]).all()
    ref, ref_lse = p.reference()
    out, lse = psa.forward(**p.kwargs(), return_lse=True)
    assert np.isfinite(ref).all() and np.abs(out - ref).max() < 1e-3
    if fill == "selected":  # pages of blocks no query selects stay zero, the others are drawn
        seq = np.repeat(np.arange(3), T)
        chosen = np.zeros(p.num_pages, dtype=bool)
        for t, h, r in zip(*np.nonzero(p.selected >= 0)):
            s = p.selected[t, h, r]
            chosen[p.block_tables[seq[t], s * 4:(s + 1) * 4]] = True
        assert (p.k_cache[~chosen] == 0).all() and (p.v_cache[~chosen] == 0).all()
        assert (p.k_cache[chosen] != 0).any(axis=(1, 2, 3)).all()
