"""The readable index branch: loop references for block scores (R22) and top-k (R24).

Slow and short on purpose, and sharing no code with the vectorised backend beyond input
validation, so that agreement between the two is evidence. Block scores are computed in float64.
"""

from __future__ import annotations

import math

import numpy as np

from ..reference import float32_scores

from ._validation import validate_block_scores, validate_select_topk

__all__ = ["visible_positions", "block_scores_reference", "select_topk_reference"]


def visible_positions(block_table_row, s: int, L: int, T: int, i: int, *, block_size: int, page_size: int,
                      causal: bool) -> list[int]:
    """Positions of block ``s`` visible to query ``i`` of a sequence with ``T`` queries (R22)."""
    # --8<-- [start:visible]
    out = []
    for p in range(s * block_size, min((s + 1) * block_size, L)):  # in the block and < L_b
        if block_table_row[p // page_size] < 0:
            continue  # unmapped page: never read
        if causal and p > L - T + i:
            continue  # in the query's future (right-aligned, as R9)
        out.append(p)
    return out
    # --8<-- [end:visible]


def block_scores_reference(index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens=None, *,
                           block_size, softmax_scale=None, causal=True, kv_layout="HND") -> np.ndarray:
    """Block scores of R22 with plain loops, in float64.

    Same arguments as ``block_scores`` (validated the same way).

    Returns
    -------
    ndarray float64 [Tq, Hkv, msb]
    """
    p = validate_block_scores("block_scores_reference", index_q, index_k_cache, block_tables, cu_seqlens_q,
                              used_kv_lens, block_size=block_size, softmax_scale=softmax_scale, causal=causal,
                              kv_layout=kv_layout)
    ik = np.asarray(p.index_k_cache).astype(np.float64)
    nhd = p.kv_layout == "NHD"
    iq = p.index_q.astype(np.float64)
    S, Hk = p.page_size, p.num_index_heads
    out = np.full((p.num_queries, p.num_kv_heads, p.msb), -np.inf)
    # --8<-- [start:scores]
    for b in range(p.num_seqs):
        lo, hi = int(p.cu_seqlens_q[b]), int(p.cu_seqlens_q[b + 1])
        L, T = int(p.used_kv_lens[b]), hi - lo
        for t in range(lo, hi):
            for h in range(p.num_kv_heads):
                hk = h if Hk > 1 else 0  # one shared index key head, or one per KV head
                for s in range(p.msb):
                    pos = visible_positions(p.block_tables[b], s, L, T, t - lo, block_size=p.block_size,
                                            page_size=S, causal=p.causal)
                    if not pos:
                        continue  # no visible position: -inf
                    pages = p.block_tables[b][[x // S for x in pos]]
                    offs = [x % S for x in pos]
                    k = ik[pages, offs, hk] if nhd else ik[pages, hk, offs]  # [n, d_idx] (R34)
                    with np.errstate(invalid="ignore"):  # inf * 0 in non-finite keys: NaN
                        logits = float32_scores(p.softmax_scale * (k @ iq[t, h]))  # overflow: +-inf
                    out[t, h, s] = math.nan if np.isnan(logits).any() else logits.max()
    # --8<-- [end:scores]
    return out


def select_topk_reference(scores, topk, *, force_local=True, cu_seqlens_q=None, used_kv_lens=None,
                          block_size=None) -> np.ndarray:
    """Top-k of R24 with Python's ``sorted`` on the key ``(-score, block id)``.

    Same arguments as ``select_topk``.

    Returns
    -------
    ndarray int32 [Tq, Hkv, topk]
    """
    p = validate_select_topk("select_topk_reference", scores, topk, force_local=force_local,
                             cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens, block_size=block_size)
    Tq, Hkv, msb = p.scores.shape
    out = np.full((Tq, Hkv, p.topk), -1, dtype=np.int32)
    # --8<-- [start:topk]
    for t in range(Tq):
        local = int(p.local_block[t])  # -1: no forced block
        for h in range(Hkv):
            row = [float(x) for x in p.scores[t, h]]
            candidates = [s for s in range(msb) if s != local and row[s] > -math.inf]  # not NaN, not -inf
            ranked = sorted(candidates, key=lambda s: (-row[s], s))  # -0.0 == 0.0: a tie, lower id first
            chosen = ([local] if local >= 0 else []) + ranked
            chosen = chosen[:p.topk]
            out[t, h, :len(chosen)] = chosen
    # --8<-- [end:topk]
    return out
