"""The log-sum-exp combine of partials into attention (R15), vectorised in numpy."""

from __future__ import annotations

import numpy as np

from ._types import KVOuterIndex, Partials

__all__ = ["combine_partials_numpy"]


def combine_partials_numpy(partials: Partials, index: KVOuterIndex, *,
                           o_row: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Combine per-edge partials into ``out`` [Tq, Hq, D] and ``lse`` [Tq, Hq], float32 (R15).

    The edges of a row are at most ``topk``; the combine walks them in *layers* (the j-th edge of
    every row that has one), so each step is a dense, contiguous update of all rows, and the sum
    order is the rank order of ``selected`` (deterministic, R19). A row whose edges all have
    ``m = -inf`` (or that has no edge) gives ``out = 0``, ``lse = -inf`` (R11); an edge with
    ``m = -inf`` is skipped, and a NaN or ``+inf`` maximum makes the row NaN (R26). ``o_row``, when
    given, maps edge e to its row of ``partials.o`` (a backend's padded buffer).
    """
    o, m, l = partials.o, partials.m, partials.l
    E, G = m.shape
    D = o.shape[2]
    Tq, Hkv = index.num_queries, index.num_kv_heads
    R = Tq * Hkv
    counts = np.diff(index.row_ptr)
    first = index.row_ptr[:-1]
    kmax = int(counts.max()) if R else 0
    layers = []  # (rows having a j-th edge, their j-th edge id)
    for j in range(kmax):
        rows = np.flatnonzero(counts > j)
        layers.append((rows, index.row_edges[first[rows] + j]))

    # --8<-- [start:combine]
    M = np.full((R, G), -np.inf, dtype=np.float32)  # M = max_e m_e
    for rows, e in layers:
        M[rows] = np.maximum(M[rows], np.take(m, e, axis=0))
    ok = M != -np.inf  # else every edge of the row is empty: out = 0, lse = -inf (NaN stays NaN)
    Ms = np.where(ok, M, 0).astype(np.float32)
    lsum = np.zeros((R, G), dtype=np.float32)
    acc = np.zeros((R, G, D), dtype=np.float32)
    for rows, e in layers:
        m_e = np.take(m, e, axis=0)
        live = m_e != -np.inf  # an edge with m = -inf is skipped: its l and o are not read
        l_e, o_e = np.take(l, e, axis=0), np.take(o, e if o_row is None else o_row[e], axis=0)
        if not live.all():
            l_e, o_e = np.where(live, l_e, 0), np.where(live[..., None], o_e, 0)
        with np.errstate(invalid="ignore", over="ignore"):
            w = np.where(live, np.exp(m_e - Ms[rows]), 0).astype(np.float32)  # exp(m_e - M)
            lsum[rows] += w * l_e
            acc[rows] += w[..., None] * o_e
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(ok[..., None], acc / np.where(ok, lsum, 1)[..., None], 0).astype(np.float32)
        lse = np.where(ok, M + np.log(np.where(ok, lsum, 1)), -np.inf).astype(np.float32)
    # --8<-- [end:combine]
    return out.reshape(Tq, Hkv * G, D), lse.reshape(Tq, Hkv * G)
