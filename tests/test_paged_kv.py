"""block_tables_from_indptr: FlashInfer's CSR page tables as block_tables and used_kv_lens (R2, R4, R34 guide)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_sparse_attn as psa


def test_R2_R4_a_csr_table_becomes_block_tables_and_lengths():
    bt, lens = psa.block_tables_from_indptr([0, 3, 3, 4], [7, 2, 5, 0], [2, 0, 1], page_size=4, block_size=8)
    assert bt.dtype == np.int32 and lens.dtype == np.int32
    # the longest sequence has 3 pages: rounded up to 2 blocks of 2 pages
    assert bt.tolist() == [[7, 2, 5, -1], [-1, -1, -1, -1], [0, -1, -1, -1]]
    assert lens.tolist() == [2 * 4 + 2, 0, 1]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_R2_R4_round_trip_and_attention_agree_with_the_csr_pages(data):
    """The rows list each sequence's pages in order, and attention over every block reads exactly
    the positions the CSR table describes (the last page cut at paged_kv_last_page_len)."""
    S = data.draw(st.sampled_from([1, 2, 4]))
    ppb = data.draw(st.integers(1, 3))
    counts = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    P = max(1, sum(counts))
    perm = np.array(data.draw(st.permutations(range(P))))
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = perm[:indptr[-1]]
    last = [data.draw(st.integers(1, S)) if c else 0 for c in counts]
    bt, lens = psa.block_tables_from_indptr(indptr, indices, last, page_size=S, block_size=S * ppb)
    for b, c in enumerate(counts):
        assert bt[b, :c].tolist() == indices[indptr[b]:indptr[b + 1]].tolist()
        assert (bt[b, c:] == -1).all()
        assert lens[b] == ((c - 1) * S + last[b] if c else 0)
    assert bt.shape[1] % ppb == 0 and bt.shape[1] >= ppb
    # attention over all blocks = dense attention over the CSR positions, in NHD as FlashInfer holds them
    rng = np.random.default_rng(0)
    D, Hkv = 4, 2
    k = rng.standard_normal((P, S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((P, S, Hkv, D)).astype(np.float32)
    B = len(counts)
    q = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    msb = bt.shape[1] // ppb
    sel = np.broadcast_to(np.arange(msb, dtype=np.int32), (B, Hkv, msb))
    out = psa.forward(q, k, v, bt, sel, np.arange(B + 1), used_kv_lens=lens, block_size=S * ppb, kv_layout="NHD")
    for b in range(B):
        pages = indices[indptr[b]:indptr[b + 1]]
        rows = [(p, o) for j, p in enumerate(pages) for o in range(S if j < len(pages) - 1 else last[b])]
        for h in range(Hkv):
            if not rows:
                assert (out[b, h] == 0).all()
                continue
            kk = np.array([k[p, o, h] for p, o in rows], np.float64)
            vv = np.array([v[p, o, h] for p, o in rows], np.float64)
            z = kk @ q[b, h] / np.sqrt(D)
            w = np.exp(z - z.max())
            np.testing.assert_allclose(out[b, h], w @ vv / w.sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, rule, words", [
    (([1, 2], [0, 1], [1]), "R2", "paged_kv_indptr must start at 0"),
    (([0, 2, 1], [0, 1], [1, 1]), "R2", "paged_kv_indptr must be non-decreasing"),
    (([0, 3], [0, 1], [1]), "R2", "paged_kv_indices must hold"),
    (([0, 1], [-1], [1]), "R2", "paged_kv_indices must be page ids >= 0"),
    (([0, 1], [0], [1, 1]), "R4", "paged_kv_last_page_len must have B=1"),
    (([0, 1], [0], [0]), "R4", r"paged_kv_last_page_len\[0\] must be in \[1, page_size=4\]"),
    (([0, 1], [0], [5]), "R4", r"paged_kv_last_page_len\[0\] must be in \[1, page_size=4\]"),
    (([0, 0], np.zeros(0, np.int32), [2]), "R4", "no page"),
    (([0, 1], [0.5], [1]), "R7", "integer dtype"),
])
def test_R2_R4_malformed_tables_are_refused(args, rule, words):
    with pytest.raises(psa.SpecError, match=words) as e:
        psa.block_tables_from_indptr(*args, page_size=4, block_size=8)
    assert e.value.rule == rule and f"[{rule}]" in str(e.value)


def test_R5_block_size_must_be_a_multiple_of_the_page_size():
    with pytest.raises(psa.SpecError, match=r"block_size must be a multiple of page_size=4.*\[R5\]"):
        psa.block_tables_from_indptr([0, 1], [0], [1], page_size=4, block_size=6)
