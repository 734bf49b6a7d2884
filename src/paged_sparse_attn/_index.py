"""The KV-outer index (R13): invert ``selected`` into edges grouped by (KV head, block).

Vectorised: one ``lexsort`` and a few ``bincount``/``cumsum``; no Python loop over edges.
"""

from __future__ import annotations

import numpy as np

from ._types import KVOuterIndex

__all__ = ["query_positions", "build_index_arrays"]


def query_positions(cu_seqlens_q: np.ndarray, used_kv_lens: np.ndarray, causal: bool):
    """Per query t: its sequence ``b`` and the exclusive end ``hi`` of the positions it may see.

    ``hi = L_b`` without causal; right-aligned causal (R9) gives ``hi = min(L_b, L_b - T_b + i + 1)``,
    which is <= 0 when the query sees nothing.

    Returns
    -------
    seq : ndarray int64 [Tq]
    hi : ndarray int64 [Tq]
    """
    # --8<-- [start:causal]
    counts = np.diff(cu_seqlens_q).astype(np.int64)  # T_b
    seq = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)  # b of each query
    L = used_kv_lens.astype(np.int64)[seq]  # L_b of each query
    hi = L.copy()
    if causal:
        i = np.arange(seq.shape[0], dtype=np.int64) - cu_seqlens_q[seq]  # index within sequence
        hi = np.minimum(L, L - counts[seq] + i + 1)  # sees p <= L_b - T_b + i
    # --8<-- [end:causal]
    return seq, hi


def _edge_order(h: np.ndarray, b: np.ndarray, blk: np.ndarray, E: int, *, B: int, msb: int) -> np.ndarray:
    """Permutation sorting entries by (h, b, s, t), given entries already in t-major order.

    Equivalent to ``np.lexsort((t, blk, b, h))``; faster: a stable radix sort on a 16-bit slot key
    when the slots fit, else a plain sort on a unique 64-bit (slot, position) key.
    """
    slot = (h * B + b) * msb + blk  # slot key; entries of one slot stay in t order (stable)
    n_slots = max(1, B * msb * (int(h.max()) + 1 if E else 1))
    if n_slots <= 1 << 16:
        return np.argsort(slot.astype(np.uint16), kind="stable")
    return np.argsort(slot * E + np.arange(E, dtype=np.int64))  # unique keys: any sort is stable


def build_index_arrays(
    selected: np.ndarray,
    block_tables: np.ndarray,
    cu_seqlens_q: np.ndarray,
    used_kv_lens: np.ndarray,
    *,
    block_size: int,
    page_size: int,
    causal: bool,
) -> KVOuterIndex:
    """Build the R13 index from validated int32 inputs (see :func:`paged_sparse_attn.build_kvouter_index`)."""
    Tq, Hkv, K = selected.shape
    msb = block_tables.shape[1] // (block_size // page_size)
    seq, hi = query_positions(cu_seqlens_q, used_kv_lens, causal)

    # --8<-- [start:edges]
    s = selected.astype(np.int64)
    start = s * block_size  # first position of the block
    # kept: a real block, not entirely >= L_b, not entirely in the future (R13)
    kept = (s >= 0) & (start < hi[:, None, None])
    t, h, rank = np.nonzero(kept)  # row-major: (t, h, rank) order
    blk = s[t, h, rank]
    b = seq[t]
    length = np.minimum(block_size, hi[t] - blk * block_size)
    # edge order: KV head, then slot (b, s), then query t
    order = _edge_order(h, b, blk, t.shape[0], B=block_tables.shape[0], msb=msb)
    # --8<-- [end:edges]

    def i32(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.int32)

    e_t, e_h, e_b, e_s = (np.take(a, order) for a in (t, h, b, blk))
    E = e_t.shape[0]

    # slot groups: runs of equal (h, b, s)
    if E:
        new = np.ones(E, dtype=bool)
        new[1:] = (e_h[1:] != e_h[:-1]) | (e_b[1:] != e_b[:-1]) | (e_s[1:] != e_s[:-1])
        starts = np.flatnonzero(new)
    else:
        starts = np.zeros(0, dtype=np.int64)
    slot_ptr = np.append(starts, E)

    # rows (t, h) -> their edges in rank order; np.nonzero already enumerated (t, h, rank)
    rows = t * Hkv + h
    row_ptr = np.zeros(Tq * Hkv + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=Tq * Hkv), out=row_ptr[1:])
    inverse = np.empty(E, dtype=np.int64)
    inverse[order] = np.arange(E)  # position of each (t, h, rank) entry in edge order

    return KVOuterIndex(
        edge_query=i32(e_t),
        edge_head=i32(e_h),
        edge_seq=i32(e_b),
        edge_block=i32(e_s),
        edge_rank=i32(np.take(rank, order)),
        edge_len=i32(np.take(length, order)),
        slot_ptr=i32(slot_ptr),
        slot_head=i32(e_h[starts]),
        slot_seq=i32(e_b[starts]),
        slot_block=i32(e_s[starts]),
        row_ptr=i32(row_ptr),
        row_edges=i32(inverse),
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        num_queries=Tq,
        num_kv_heads=Hkv,
        block_size=block_size,
        page_size=page_size,
        msb=msb,
        causal=causal,
    )
