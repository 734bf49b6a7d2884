"""The log-sum-exp combine of partials into attention (R15), vectorised in numpy."""

from __future__ import annotations

import numpy as np

from ._types import KVOuterIndex, Partials

__all__ = ["combine_partials_numpy"]


def combine_partials_numpy(partials: Partials, index: KVOuterIndex) -> tuple[np.ndarray, np.ndarray]:
    """Combine per-edge partials into ``out`` [Tq, Hq, D] and ``lse`` [Tq, Hq], float32 (R15).

    Rows are reduced in rank order with ``reduceat`` (deterministic, R19). A row whose edges all
    have ``m = -inf`` (or that has no edge) gives ``out = 0``, ``lse = -inf`` (R11).
    """
    o, m, l = partials.o, partials.m, partials.l
    E, G, D = o.shape
    Tq, Hkv = index.num_queries, index.num_kv_heads
    out = np.zeros((Tq * Hkv, G, D), dtype=np.float32)
    lse = np.full((Tq * Hkv, G), -np.inf, dtype=np.float32)
    counts = np.diff(index.row_ptr)
    nonempty = np.flatnonzero(counts)
    if nonempty.size:
        # --8<-- [start:combine]
        perm = index.row_edges  # edges grouped by row, in rank order
        m_r = m[perm].astype(np.float32)
        starts = index.row_ptr[:-1][nonempty]
        M = np.maximum.reduceat(m_r, starts, axis=0)  # [rows, G]: max m over the row's edges
        M_e = np.repeat(M, counts[nonempty], axis=0)
        finite = M_e > -np.inf  # M = -inf: every edge of the row is empty
        with np.errstate(invalid="ignore", over="ignore"):
            w = np.where(finite, np.exp(m_r - np.where(finite, M_e, 0)), 0).astype(np.float32)
            w[m_r == -np.inf] = 0  # an empty edge contributes nothing (its o and l are 0)
        l_row = np.add.reduceat(w * l[perm], starts, axis=0)
        o_row = np.add.reduceat(w[..., None] * o[perm], starts, axis=0)
        ok = M > -np.inf
        with np.errstate(divide="ignore", invalid="ignore"):
            out[nonempty] = np.where(ok[..., None], o_row / np.where(ok, l_row, 1)[..., None], 0)
            lse[nonempty] = np.where(ok, M + np.log(np.where(ok, l_row, 1)), -np.inf)
        # --8<-- [end:combine]
    return out.reshape(Tq, Hkv * G, D), lse.reshape(Tq, Hkv * G)
