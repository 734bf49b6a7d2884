"""The numpy index branch: block scores (R22) and exp-free top-k selection (R24), vectorised.

Block scores: per sequence, the index keys of a chunk of blocks are gathered once (unmapped
pages and positions >= L_b zeroed, so they never reach the arithmetic, R10) and multiplied
against the index queries of a chunk of queries with one batched float32 matmul per KV head; the
masked positions are set to -inf and a max over each block's positions gives its score.

Top-k: a partition finds each row's k-th largest score, ties at that value are resolved to the
lower block ids, and a stable argsort orders the chosen ids. Only comparisons are used, so the
result is an exact function of the float32 scores (R24).
"""

from __future__ import annotations

import numpy as np

from .._types import DeviceArray, IndexProblem, TopkProblem
from ..errors import UnsupportedError

__all__ = ["block_scores_numpy", "select_topk_numpy"]

# Elements (float32) one chunk's score tensor may hold: bounds temporary memory to ~100 MB.
_CHUNK_ELEMS = 1 << 23


def block_scores_numpy(problem: IndexProblem) -> np.ndarray:
    """Block scores of R22.

    Parameters
    ----------
    problem : IndexProblem

    Returns
    -------
    ndarray float32 [Tq, Hkv, msb]
        Max over each block's visible positions of ``scale * index_q . index_k``; ``-inf`` where
        no position is visible; NaN where a visible product is NaN.
    """
    ik = problem.index_k_cache
    if isinstance(ik, DeviceArray):
        raise UnsupportedError(
            "backend 'numpy' cannot read a device-resident index_k_cache; pass a numpy array or use "
            f"the backend that holds it ({ik.backend!r}) [R18]")
    if problem.kv_layout == "NHD":  # R34: a view [P, Hk_idx, S, d_idx] of the same memory, no copy
        ik = ik.transpose(0, 2, 1, 3)
    Tq, Hkv, d = problem.index_q.shape
    BS, S, ppb, msb = problem.block_size, problem.page_size, problem.pages_per_block, problem.msb
    out = np.full((Tq, Hkv, msb), -np.inf, dtype=np.float32)
    if problem.num_pages == 0:
        return out  # no page exists, so every block_tables entry is -1 (R2): nothing is visible
    iq = problem.index_q.astype(np.float32, copy=False)
    scale = np.float32(problem.softmax_scale)
    cu = problem.cu_seqlens_q.astype(np.int64)
    end = problem.query_end.astype(np.int64)
    offs = np.arange(BS, dtype=np.int64)
    for b in range(problem.num_seqs):
        lo, hi = int(cu[b]), int(cu[b + 1])
        L = int(problem.used_kv_lens[b])
        nblk = min(msb, -(-L // BS))  # blocks holding a position < L_b; the rest stay -inf
        if hi == lo or nblk == 0:
            continue
        # bound both the gathered keys [Hk_idx, n, d] and the scores [Hkv, tc, n]
        bc = max(1, min(nblk, _CHUNK_ELEMS // (BS * max(Hkv, ik.shape[1] * d))))
        for b0 in range(0, nblk, bc):
            blocks = np.arange(b0, min(nblk, b0 + bc), dtype=np.int64)
            K, valid, pos = _gather_keys(ik, problem.block_tables[b], blocks, L, ppb, S, offs)
            tc = max(1, _CHUNK_ELEMS // (Hkv * K.shape[1]))
            for t0 in range(lo, hi, tc):
                t1 = min(hi, t0 + tc)
                # [Hkv, tc, d] @ [Hk_idx, d, n] -> [Hkv, tc, n]; Hk_idx == 1 broadcasts over heads
                sc = np.matmul(iq[t0:t1].transpose(1, 0, 2), K.transpose(0, 2, 1))
                with np.errstate(over="ignore", invalid="ignore"):  # float32 logits: overflow is +-inf
                    sc *= scale
                # visible: mapped, < L_b and (causal) not in the future: pos < query_end (R22)
                vis = valid[None, :] & (pos[None, :] < end[t0:t1, None])  # [tc, n]
                sc = np.where(vis[None], sc, np.float32(-np.inf))
                mx = sc.reshape(Hkv, t1 - t0, blocks.shape[0], BS).max(axis=-1)  # NaN propagates
                out[t0:t1, :, b0:b0 + blocks.shape[0]] = mx.transpose(1, 0, 2)
    return out


def _gather_keys(ik, bt_row, blocks, L, ppb, S, offs):
    """Index keys of ``blocks`` of one sequence: [Hk_idx, n, d] float32, masks [n], positions [n]."""
    pages = bt_row[blocks[:, None] * ppb + np.arange(ppb)]  # [nb, ppb]
    mapped = pages >= 0
    pos = (blocks[:, None] * (ppb * S) + offs[None, :]).reshape(-1)  # [n] logical positions
    valid = np.repeat(mapped, S, axis=1).reshape(-1) & (pos < L)
    K = ik[np.where(mapped, pages, 0)]  # [nb, ppb, Hk, S, d]
    K = K.transpose(2, 0, 1, 3, 4).reshape(ik.shape[1], -1, ik.shape[3])
    # never let unmapped pages or positions >= L_b reach the arithmetic (R10 analogue). C order
    # whatever the cache's layout (R34): np.where keeps its input's memory order, and an NHD
    # cache's transposed view gave the matmul other strides, for which a BLAS may sum in another
    # order (last-bit differences between the layouts, seen on one machine's numpy)
    K = np.ascontiguousarray(np.where(valid[None, :, None], K, 0), dtype=np.float32)
    return K, valid, pos


def select_topk_numpy(problem: TopkProblem) -> np.ndarray:
    """Exp-free top-k of R24.

    Parameters
    ----------
    problem : TopkProblem

    Returns
    -------
    ndarray int32 [Tq, Hkv, topk]
        Per row: the forced local block (if any) first, then the best other blocks by descending
        score, ties to the lower id; ``-1`` padding at the end. NaN and ``-inf`` never selected.
    """
    sc, k = problem.scores, problem.topk
    Tq, Hkv, msb = sc.shape
    if k == 0 or Tq * Hkv == 0:
        return np.full((Tq, Hkv, k), -1, dtype=np.int32)
    # --8<-- [start:key]
    key = np.where(sc > -np.inf, sc, np.float32(-np.inf))  # NaN -> -inf: never a candidate
    key = np.where(key == 0, np.float32(0), key)  # -0 and +0 are one value (a tie)
    local = problem.local_block.astype(np.int64)
    has_local = local >= 0
    t_loc = np.flatnonzero(has_local)
    key[t_loc, :, local[t_loc]] = -np.inf  # the local block takes slot 0, not a ranked slot
    # --8<-- [end:key]
    rows = key.reshape(Tq * Hkv, msb)
    n = min(k, msb)
    if n < msb:
        # the n-th largest value; everything above it is in, ties at it go to the lower ids
        thr = np.partition(rows, msb - n, axis=1)[:, msb - n][:, None]
        above = rows > thr
        need = n - above.sum(axis=1, keepdims=True)
        tie = rows == thr
        take = above | (tie & (np.cumsum(tie, axis=1) <= need))
        ids = np.nonzero(take)[1].reshape(-1, n)  # exactly n per row, ascending ids
    else:
        ids = np.broadcast_to(np.arange(msb), rows.shape)
    vals = np.take_along_axis(rows, ids, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")  # descending score, ties keep ascending id
    ids = np.take_along_axis(ids, order, axis=1)
    vals = np.take_along_axis(vals, order, axis=1)
    ranked = np.where(vals > -np.inf, ids, -1)  # -inf candidates are padding, already at the end
    out = np.full((Tq * Hkv, k), -1, dtype=np.int32)
    out[:, :n] = ranked
    # rows with a local block: [local, best k-1 others]
    loc_rows = np.repeat(has_local, Hkv)
    shifted = np.concatenate([np.repeat(local, Hkv)[:, None], out[:, :-1]], axis=1)
    out = np.where(loc_rows[:, None], shifted, out).astype(np.int32)
    return out.reshape(Tq, Hkv, k)
