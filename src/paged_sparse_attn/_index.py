"""The KV-outer index (R13): invert ``selected`` into edges grouped by (KV head, block).

Vectorised: one stable sort and a few ``bincount``/``cumsum``; no Python loop over edges.
"""

from __future__ import annotations

import numpy as np

from ._types import KVOuterIndex, SeqLayout

__all__ = ["query_positions", "local_blocks", "build_index_arrays", "run_starts"]


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


def local_blocks(cu: np.ndarray, lens: np.ndarray, block_size: int) -> np.ndarray:
    """R24: the block holding query t's own position ``L_b - T_b + i``, or -1 when it is < 0.

    The position is at most ``L_b - 1 <= msb * block_size - 1`` (R4), so the block id is < msb.
    """
    # --8<-- [start:local]
    _, end = query_positions(cu, lens, causal=True)  # end = L_b - T_b + i + 1 (<= L_b)
    pos = end - 1  # the query's own position
    local = np.where(pos >= 0, pos // block_size, -1)
    # --8<-- [end:local]
    return np.ascontiguousarray(local, dtype=np.int32)


def run_starts(s: np.ndarray) -> np.ndarray:
    """Mask of the first element of each run of equal values (of a sorted array: of each value)."""
    new = np.empty(s.shape[0], dtype=bool)
    new[:1] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    return new


def _edge_order(slot: np.ndarray, n_slots: int) -> np.ndarray:
    """Permutation sorting entries by slot key, stably, given entries already in t-major order.

    Equivalent to ``np.lexsort((t, slot))``; faster: a stable radix sort on a 16-bit key when the
    slots fit, else a plain sort on a unique 64-bit (slot, position) key.
    """
    E = slot.shape[0]
    if n_slots <= 1 << 16:
        return np.argsort(slot.astype(np.uint16), kind="stable")
    return np.argsort(slot * E + np.arange(E, dtype=np.int64))  # unique keys: any sort is stable


def build_index_arrays(selected: np.ndarray, layout: SeqLayout) -> KVOuterIndex:
    """Build the R13 index of a validated int32 ``selected`` [Tq, Hkv, topk] over ``layout``.

    See ``paged_sparse_attn.build_kvouter_index``. The index refers to ``layout`` (it does not
    copy it): a problem and its index share one record.

    Per-call cost matters (every decode step builds one): the edge fields are taken once, in
    edge order and as int32, and the slot and row structure come from keys, not from
    comparisons of several arrays.
    """
    Tq, Hkv, K = selected.shape
    B, msb, block_size = layout.num_seqs, layout.msb, layout.block_size
    seq, hi = query_positions(layout.cu_seqlens_q, layout.used_kv_lens, layout.causal)

    # --8<-- [start:edges]
    # kept: a real block, not entirely >= L_b, not entirely in the future (R13): s * block_size
    # < hi, i.e. s < ceil(hi / block_size) (<= 0 when the query sees nothing)
    n_vis = -(-hi // block_size)
    kept = (selected >= 0) & (selected < n_vis[:, None, None])
    flat = np.flatnonzero(kept)  # row-major: (t, h, rank) order
    row = flat // K  # t * Hkv + h
    rank = flat - row * K
    t = row // Hkv
    h = row - t * Hkv
    blk = selected.reshape(-1)[flat].astype(np.int64)
    b = seq[t]
    length = np.minimum(block_size, hi[t] - blk * block_size)
    # edge order: KV head, then slot (b, s), then query t
    slot = (h * B + b) * msb + blk
    E = flat.shape[0]
    order = _edge_order(slot, max(1, B * msb * (int(h.max()) + 1 if E else 1)))
    # --8<-- [end:edges]

    # every edge field in edge order, as int32 (the values fit: R7)
    e_t, e_h, e_b, e_s, e_rank, e_len = (np.take(a.astype(np.int32), order) for a in (t, h, b, blk, rank, length))
    # slot groups: runs of equal slot key (h, b, s)
    starts = np.flatnonzero(run_starts(slot[order]))
    slot_ptr = np.empty(starts.shape[0] + 1, dtype=np.int32)
    slot_ptr[:-1] = starts
    slot_ptr[-1] = E

    # rows (t, h) -> their edges in rank order; flatnonzero already enumerated (t, h, rank)
    row_ptr = np.zeros(Tq * Hkv + 1, dtype=np.int32)
    np.cumsum(np.bincount(row, minlength=Tq * Hkv), out=row_ptr[1:])
    inverse = np.empty(E, dtype=np.int32)
    inverse[order] = np.arange(E, dtype=np.int32)  # position of each (t, h, rank) entry in edge order

    return KVOuterIndex(
        edge_query=e_t,
        edge_head=e_h,
        edge_seq=e_b,
        edge_block=e_s,
        edge_rank=e_rank,
        edge_len=e_len,
        slot_ptr=slot_ptr,
        slot_head=e_h[starts],
        slot_seq=e_b[starts],
        slot_block=e_s[starts],
        row_ptr=row_ptr,
        row_edges=inverse,
        layout=layout,
        num_queries=Tq,
        num_kv_heads=Hkv,
    )
