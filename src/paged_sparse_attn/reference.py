"""The readable spec in code: the dense oracle (R9-R11) and merge_states (R16), in float64.

``dense_reference`` is deliberately short and slow: for every query and KV head it gathers the
attended set A(t, h) of R9 and applies a textbook softmax. It shares no code with the KV-outer
backends, so agreement between the two is evidence, not tautology.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._validation import validate_forward

__all__ = ["dense_reference", "attended_positions", "merge_states", "lse_to_base2", "lse_from_base2"]


def attended_positions(block_tables, selected_row, L: int, T: int, i: int, *, block_size: int,
                       page_size: int, causal: bool) -> list[int]:
    """The attended set A(t, h) of R9 for one query, as sorted logical positions.

    Parameters
    ----------
    block_tables : ndarray [max_pages]
        The sequence's row of the block table.
    selected_row : ndarray [topk]
        ``selected[t, h, :]``.
    L, T, i : int
        ``L_b``, ``T_b`` and the query's index within its sequence.
    """
    # --8<-- [start:attended]
    positions = []
    for s in selected_row:
        if s < 0:
            continue  # empty slot
        for p in range(s * block_size, min((s + 1) * block_size, L)):
            if block_tables[p // page_size] < 0:
                continue  # unmapped page: never read (R10)
            if causal and p > L - T + i:
                continue  # right-aligned causal: the last query sees up to L - 1
            positions.append(p)
    return sorted(positions)
    # --8<-- [end:attended]


def dense_reference(q, k_cache, v_cache, block_tables, selected, cu_seqlens_q, *, used_kv_lens=None,
                    block_size, softmax_scale=None, causal=False) -> tuple[np.ndarray, np.ndarray]:
    """Attention over exactly the attended sets of R9, in float64 (the oracle).

    Same arguments as [`forward`][paged_sparse_attn.forward]; validated the same way (R17).

    Returns
    -------
    out : ndarray float64 [Tq, Hq, D]
        0 for rows with an empty attended set.
    lse : ndarray float64 [Tq, Hq]
        Natural-log log-sum-exp of the scaled scores; -inf for empty rows.
    """
    p = validate_forward("dense_reference", q, k_cache, v_cache, block_tables, selected, cu_seqlens_q,
                         used_kv_lens=used_kv_lens, block_size=block_size, softmax_scale=softmax_scale,
                         causal=causal)
    kc, vc = np.asarray(p.k_cache), np.asarray(p.v_cache)
    Tq, Hq, D = p.q.shape
    Hkv, S, G = p.num_kv_heads, p.page_size, p.group_size
    out = np.zeros((Tq, Hq, D))
    lse = np.full((Tq, Hq), -np.inf)
    # --8<-- [start:dense]
    for b in range(p.num_seqs):
        lo, hi = int(p.cu_seqlens_q[b]), int(p.cu_seqlens_q[b + 1])
        L, T = int(p.used_kv_lens[b]), hi - lo
        for t in range(lo, hi):
            for h in range(Hkv):
                pos = attended_positions(p.block_tables[b], p.selected[t, h], L, T, t - lo,
                                         block_size=p.block_size, page_size=S, causal=p.causal)
                if not pos:
                    continue  # empty set: out = 0, lse = -inf (R11)
                pages = p.block_tables[b][[x // S for x in pos]]
                k = kc[pages, h, [x % S for x in pos]].astype(np.float64)  # [n, D]
                v = vc[pages, h, [x % S for x in pos]].astype(np.float64)
                for g in range(G):
                    hq = h * G + g  # query head hq reads KV head hq // G (R1)
                    scores = p.softmax_scale * (k @ p.q[t, hq].astype(np.float64))
                    mx = scores.max()
                    e = np.exp(scores - mx)
                    out[t, hq] = (e @ v) / e.sum()
                    lse[t, hq] = mx + math.log(e.sum())
    # --8<-- [end:dense]
    return out, lse


def _as_float(x: Any, name: str) -> np.ndarray:
    from ._validation import as_array

    a = as_array(x, "merge_states", name, "R16")
    if not np.issubdtype(a.dtype, np.floating):
        from .errors import SpecError

        raise SpecError(f"merge_states(): {name} must be a float array, got {a.dtype.name} [R16]", "R16")
    return a


def merge_states(o_a, lse_a, o_b, lse_b) -> tuple[np.ndarray, np.ndarray]:
    """Merge two normalised attention states over disjoint key sets (R16).

    Parameters
    ----------
    o_a, o_b : ndarray [..., D]
        Normalised outputs.
    lse_a, lse_b : ndarray [...]
        Their natural-log log-sum-exp (``-inf`` for an empty set).

    Returns
    -------
    o : ndarray [..., D]
    lse : ndarray [...]
        In the result dtype of the inputs (at least float32). ``(0, -inf)`` is the identity; the
        merge is commutative and associative.
    """
    o_a, lse_a, o_b, lse_b = (_as_float(x, n) for x, n in ((o_a, "o_a"), (lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b")))
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        from .errors import SpecError

        raise SpecError(
            f"merge_states(): expected o_a, o_b [..., D] and lse_a, lse_b [...] of matching shapes, "
            f"got {o_a.shape}, {lse_a.shape}, {o_b.shape}, {lse_b.shape} [R16]", "R16")
    dt = np.result_type(o_a, o_b, lse_a, lse_b, np.float32)
    # --8<-- [start:merge]
    a, b = lse_a.astype(np.float64), lse_b.astype(np.float64)
    M = np.maximum(a, b)
    ok = M != -np.inf  # NaN propagates; only (.., -inf) on both sides is empty
    Ms = np.where(ok, M, 0.0)
    wa = np.where(a > -np.inf, np.exp(a - Ms), 0.0)  # exp(-inf) = 0 exactly, no nan
    wb = np.where(b > -np.inf, np.exp(b - Ms), 0.0)
    tot = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(ok[..., None], (wa[..., None] * o_a + wb[..., None] * o_b) / np.where(ok, tot, 1)[..., None], 0.0)
        lse = np.where(ok, M + np.log(np.where(ok, tot, 1)), -np.inf)
    # --8<-- [end:merge]
    return o.astype(dt), lse.astype(dt)


def lse_to_base2(lse):
    """Convert natural-log LSE (this package's convention, R11) to base 2: ``lse / ln 2``."""
    return np.asarray(lse) / math.log(2.0)


def lse_from_base2(lse2):
    """Convert a base-2 LSE (as some kernels return) to natural log: ``lse2 * ln 2``."""
    return np.asarray(lse2) * math.log(2.0)
