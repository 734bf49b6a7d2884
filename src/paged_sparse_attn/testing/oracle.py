"""Independent oracles for the property suite: the rules written as small numpy formulas.

Nothing here calls the package's index, backends or reference: the attended sets of R9 are
boolean masks over logical positions, attention is a masked softmax in float64, and the R14
partials are recomputed per edge from those masks. Agreement with the package is evidence, not a
tautology.
"""

from __future__ import annotations

import numpy as np

from .problem import AttentionProblem

__all__ = [
    "attended_mask",
    "read_cells",
    "gather_logical",
    "masked_attention",
    "edge_partials",
]


def _query_bounds(p: AttentionProblem) -> tuple[np.ndarray, np.ndarray]:
    """Per query: sequence b and the exclusive end of the positions it may see (R9)."""
    seq = p.seq_of_query
    cu = np.asarray(p.cu_seqlens_q, dtype=np.int64)
    L = p.kv_lens[seq]
    if not p.causal:
        return seq, L
    T = np.diff(cu)[seq]
    i = np.arange(p.num_queries, dtype=np.int64) - cu[seq]
    return seq, np.minimum(L, L - T + i + 1)  # right-aligned: sees p <= L - T + i


def attended_mask(p: AttentionProblem, selected: np.ndarray | None = None) -> np.ndarray:
    """A(t, h) of R9 as a boolean mask over logical positions, shape [Tq, Hkv, msb * BS].

    Parameters
    ----------
    p : AttentionProblem
    selected : ndarray [Tq, Hkv, topk], optional
        A selection to use instead of ``p.selected``.
    """
    sel = np.asarray(p.selected if selected is None else selected, dtype=np.int64)
    bt = np.asarray(p.block_tables, dtype=np.int64)
    Tq, Hkv = sel.shape[:2]
    BS, S, msb = p.block_size, p.page_size, p.msb
    pos = np.arange(msb * BS)
    chosen = np.zeros((Tq, Hkv, msb + 1), dtype=bool)  # column msb absorbs the -1 slots
    t, h, r = np.nonzero(np.ones(sel.shape, dtype=bool))
    chosen[t, h, np.where(sel[t, h, r] >= 0, sel[t, h, r], msb)] = True
    seq, hi = _query_bounds(p)
    mapped = bt[seq][:, pos // S] >= 0  # [Tq, npos]
    return chosen[:, :, pos // BS] & mapped[:, None, :] & (pos[None, None, :] < hi[:, None, None])


def read_cells(p: AttentionProblem, mask: np.ndarray | None = None) -> np.ndarray:
    """Physical cache cells some query attends: boolean [P, Hkv, S] (everything else is never read, R10).

    Parameters
    ----------
    mask : ndarray [Tq, Hkv, msb * BS], optional
        Attended positions (default ``attended_mask``).
    """
    mask = attended_mask(p) if mask is None else mask
    bt = np.asarray(p.block_tables, dtype=np.int64)
    S = p.page_size
    cells = np.zeros((p.num_pages, p.num_kv_heads, S), dtype=bool)
    t, h, pos = np.nonzero(mask)
    cells[bt[p.seq_of_query[t], pos // S], h, pos % S] = True
    return cells


def gather_logical(p: AttentionProblem, cache: np.ndarray) -> np.ndarray:
    """The cache in logical order per sequence: float64 [B, msb * BS, Hkv, D]; unmapped pages read as 0."""
    bt = np.asarray(p.block_tables, dtype=np.int64)
    S = p.page_size
    pos = np.arange(p.msb * p.block_size)
    pages = bt[:, pos // S]  # [B, npos]
    out = np.asarray(cache)[np.maximum(pages, 0), :, (pos % S)[None, :]].astype(np.float64)
    return np.where((pages >= 0)[..., None, None], out, 0.0)


def masked_attention(p: AttentionProblem, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention over exactly the masked positions (R11), float64.

    Returns
    -------
    out : ndarray float64 [Tq, Hq, D]
        0 where the mask row is empty.
    lse : ndarray float64 [Tq, Hq]
        -inf where the mask row is empty.
    """
    mask = attended_mask(p) if mask is None else mask
    G, D = p.group_size, p.head_dim
    seq = p.seq_of_query
    K = gather_logical(p, p.k_cache)[seq]  # [Tq, npos, Hkv, D]
    V = gather_logical(p, p.v_cache)[seq]
    q = np.asarray(p.q, dtype=np.float64).reshape(p.num_queries, p.num_kv_heads, G, D)
    m = mask[:, :, None, :]  # [Tq, Hkv, 1, npos]
    K = np.where(mask.transpose(0, 2, 1)[..., None], K, 0.0)  # never multiply unattended data
    V = np.where(mask.transpose(0, 2, 1)[..., None], V, 0.0)
    s = p.scale * np.einsum("thgd,tphd->thgp", q, K)
    s = np.where(m, s, -np.inf)
    mx = s.max(axis=-1, initial=-np.inf)
    ok = np.isfinite(mx)
    w = np.where(m, np.exp(s - np.where(ok, mx, 0.0)[..., None]), 0.0)
    tot = w.sum(axis=-1)
    out = np.einsum("thgp,tphd->thgd", w, V) / np.where(ok, tot, 1.0)[..., None]
    lse = np.where(ok, np.where(ok, mx, 0.0) + np.log(np.where(ok, tot, 1.0)), -np.inf)
    Hq = p.num_q_heads
    return out.reshape(p.num_queries, Hq, D), lse.reshape(p.num_queries, Hq)


def edge_partials(p: AttentionProblem, index) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The R14 partials of every edge of ``index``, float64, from the R9 masks.

    An edge (t, h, s) attends A(t, h) restricted to block s. Returns ``o`` [E, G, D], ``m``
    [E, G], ``l`` [E, G]; an edge that attends nothing has ``m = -inf``, ``l = 0``, ``o = 0``.
    """
    mask = attended_mask(p)
    BS, G, D = p.block_size, p.group_size, p.head_dim
    t = np.asarray(index.edge_query, dtype=np.int64)
    h = np.asarray(index.edge_head, dtype=np.int64)
    s = np.asarray(index.edge_block, dtype=np.int64)
    pos = s[:, None] * BS + np.arange(BS)  # [E, BS]
    att = mask[t[:, None], h[:, None], pos]  # [E, BS]
    seq = p.seq_of_query[t]
    K = gather_logical(p, p.k_cache)[seq[:, None], pos, h[:, None]]  # [E, BS, D]
    V = gather_logical(p, p.v_cache)[seq[:, None], pos, h[:, None]]
    K = np.where(att[..., None], K, 0.0)
    V = np.where(att[..., None], V, 0.0)
    q = np.asarray(p.q, dtype=np.float64).reshape(p.num_queries, p.num_kv_heads, G, D)[t, h]  # [E, G, D]
    sc = np.where(att[:, None, :], p.scale * np.einsum("egd,ebd->egb", q, K), -np.inf)
    m = sc.max(axis=-1, initial=-np.inf)
    ok = np.isfinite(m)
    w = np.where(att[:, None, :], np.exp(sc - np.where(ok, m, 0.0)[..., None]), 0.0)
    return np.einsum("egb,ebd->egd", w, V), m, w.sum(axis=-1)
