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

__all__ = ["dense_reference", "float32_scores", "attended_positions", "merge_states", "lse_to_base2", "lse_from_base2"]


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


_F32_MAX = float(np.finfo(np.float32).max)


def float32_scores(z: np.ndarray) -> np.ndarray:
    """Scores as float32 arithmetic has them (R26): a magnitude beyond the float32 range is +-inf.

    ``z`` stays float64 (no rounding of finite scores, which R20's tolerance covers); only the
    overflow of float32 is modelled, so that the reference and a float32 backend agree on it.
    """
    with np.errstate(invalid="ignore"):
        big = np.abs(z) > _F32_MAX  # False for NaN
    return np.where(big, np.copysign(np.inf, z), z)


def dense_reference(q, k_cache, v_cache, block_tables, selected, cu_seqlens_q, *, used_kv_lens=None,
                    block_size, softmax_scale=None, causal=False, kv_layout="HND") -> tuple[np.ndarray, np.ndarray]:
    """Attention over exactly the attended sets of R9, in float64 (the oracle).

    Same arguments as [`forward`][paged_sparse_attn.forward]; validated the same way (R17).

    Returns
    -------
    out : ndarray float64 [Tq, Hq, D]
        0 for rows with an empty attended set, or whose attended scores are all -inf (R26).
    lse : ndarray float64 [Tq, Hq]
        Natural-log log-sum-exp of the scaled scores; -inf for those rows. A NaN or +inf score
        makes out and lse NaN; scores beyond the float32 range are +-inf (R26).
    """
    p = validate_forward("dense_reference", q, k_cache, v_cache, block_tables, selected, cu_seqlens_q,
                         used_kv_lens=used_kv_lens, block_size=block_size, softmax_scale=softmax_scale,
                         causal=causal, kv_layout=kv_layout)
    kc, vc = np.asarray(p.k_cache), np.asarray(p.v_cache)
    nhd = p.kv_layout == "NHD"
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
                offs = [x % S for x in pos]
                # R34: the key of (page, offset, head) is [page, h, offset] in HND, [page, offset, h] in NHD
                k = (kc[pages, offs, h] if nhd else kc[pages, h, offs]).astype(np.float64)  # [n, D]
                v = (vc[pages, offs, h] if nhd else vc[pages, h, offs]).astype(np.float64)
                for g in range(G):
                    hq = h * G + g  # query head hq reads KV head hq // G (R1)
                    with np.errstate(invalid="ignore"):  # inf * 0 in non-finite data: NaN (R26)
                        z = float32_scores(p.softmax_scale * (k @ p.q[t, hq].astype(np.float64)))
                    keep = z != -np.inf  # a -inf score removes its position (R26)
                    if not keep.any():
                        continue  # every attended score is -inf: like an empty set (R26)
                    z, vk = z[keep], v[keep]
                    if np.isnan(z).any() or (z == np.inf).any():
                        out[t, hq], lse[t, hq] = np.nan, np.nan  # NaN or +inf score (R26)
                        continue
                    mx = z.max()
                    e = np.exp(z - mx)
                    with np.errstate(invalid="ignore"):  # 0 * inf, inf - inf in values (R26)
                        out[t, hq] = (e @ vk) / e.sum()
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
    o_a, o_b : float array [..., D]
        Normalised outputs, of the same shape (at least 1-D; no broadcasting).
    lse_a, lse_b : float array [...]
        Their natural-log log-sum-exp (``-inf`` for an empty set), of shape ``o_a.shape[:-1]``.
        Any float dtype (float16, bfloat16, float32, float64); computed in float64.

    Returns
    -------
    o : ndarray float32 [..., D]
    lse : ndarray float32 [...]
        ``(0, -inf)`` is the identity (the other state comes back exactly, its ``o`` unread);
        the merge is commutative and associative. A NaN or ``+inf`` lse on either side gives
        NaN ``o`` and ``lse``; NaN and Inf in ``o`` propagate (R16).
    """
    o_a, lse_a, o_b, lse_b = (_as_float(x, n) for x, n in ((o_a, "o_a"), (lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b")))
    if (o_a.ndim < 1 or o_a.shape != o_b.shape or lse_a.shape != lse_b.shape
            or o_a.shape[:-1] != lse_a.shape):
        from .errors import SpecError

        raise SpecError(
            f"merge_states(): expected o_a, o_b [..., D] and lse_a, lse_b [...] of exactly matching shapes "
            f"(no broadcasting), got {o_a.shape}, {lse_a.shape}, {o_b.shape}, {lse_b.shape} [R16]", "R16")
    # --8<-- [start:merge]
    a, b = lse_a.astype(np.float64), lse_b.astype(np.float64)
    oa, ob = o_a.astype(np.float64), o_b.astype(np.float64)
    ea, eb = a == -np.inf, b == -np.inf  # empty sides: weight 0, o never read
    bad = np.isnan(a) | np.isnan(b) | (a == np.inf) | (b == np.inf)  # result NaN
    ok = ~(ea & eb) & ~bad
    M = np.where(ok, np.maximum(np.where(ea, b, a), np.where(eb, a, b)), 0.0)
    wa = np.where(ok & ~ea, np.exp(np.where(ok & ~ea, a, 0.0) - M), 0.0)  # exp(a - M) <= 1
    wb = np.where(ok & ~eb, np.exp(np.where(ok & ~eb, b, 0.0) - M), 0.0)
    tot = np.where(ok, wa + wb, 1.0)  # >= 1: the larger side has weight 1
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / Inf in o propagate (IEEE)
        o = (np.where(ea[..., None], 0.0, wa[..., None] * oa)
             + np.where(eb[..., None], 0.0, wb[..., None] * ob)) / tot[..., None]
    o = np.where(bad[..., None], np.nan, np.where((ea & eb)[..., None], 0.0, o))
    lse = np.where(bad, np.nan, np.where(ok, M + np.log(tot), -np.inf))
    # --8<-- [end:merge]
    return o.astype(np.float32), lse.astype(np.float32)


def lse_to_base2(lse):
    """Convert natural-log LSE (this package's convention, R11) to base 2: ``lse / ln 2``."""
    return np.asarray(lse) / math.log(2.0)


def lse_from_base2(lse2):
    """Convert a base-2 LSE (as some kernels return) to natural log: ``lse2 * ln 2``."""
    return np.asarray(lse2) * math.log(2.0)
