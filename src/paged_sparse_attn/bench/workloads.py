"""Benchmark problems: random paged caches with MSA-like selections (local block always chosen)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Workload", "make_problem", "needed_kv_bytes"]


@dataclass(frozen=True)
class Workload:
    """One benchmark geometry.

    Attributes
    ----------
    name : str
    B : int
        Sequences.
    L : int
        KV length of every sequence.
    Tq_per_seq : int
        Queries per sequence (the last ones: right-aligned causal).
    Hq, Hkv, D, page_size, block_size, topk : int
    causal : bool
    dtype : str
        Cache dtype.
    """

    name: str
    B: int
    L: int
    Tq_per_seq: int
    Hq: int = 32
    Hkv: int = 4
    D: int = 128
    page_size: int = 64
    block_size: int = 128
    topk: int = 16
    causal: bool = True
    dtype: str = "float16"

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv



def needed_kv_bytes(problem: dict) -> int:
    """Bytes of K+V a problem must read at least: each distinct (seq, KV head, block) once.

    Only positions < L_b of mapped pages count; this is the memory floor of the problem.
    """
    sel = np.asarray(problem["selected"]).astype(np.int64)
    cu = np.asarray(problem["cu_seqlens_q"])
    bt = np.asarray(problem["block_tables"])
    lens = np.asarray(problem["used_kv_lens"]).astype(np.int64)
    kc = problem["k_cache"]
    P, Hkv, S, D = kc.shape
    BS = int(problem["block_size"])
    msb = bt.shape[1] // (BS // S)
    b = np.repeat(np.arange(bt.shape[0]), np.diff(cu))
    t, h, r = np.nonzero(sel >= 0)
    keys = np.unique((b[t] * Hkv + h) * msb + sel[t, h, r])
    bb, ss = keys // (Hkv * msb), keys % msb
    tokens = np.clip(lens[bb] - ss * BS, 0, BS).sum()
    return int(tokens * D * np.dtype(kc.dtype).itemsize * 2)


def make_problem(w: Workload, seed: int = 0, fill: str = "all"):
    """Random problem for workload ``w``: scrambled physical pages, local block + random top-k.

    ``fill="selected"`` draws random values only for the pages some query selects and leaves
    the others zero (they are never read; this keeps very large caches cheap to build).

    Returns
    -------
    dict
        Arguments of :func:`paged_sparse_attn.forward` (``q, k_cache, v_cache, block_tables,
        selected, cu_seqlens_q, used_kv_lens, block_size, causal``).
    """
    rng = np.random.default_rng(seed)
    S, BS = w.page_size, w.block_size
    ppb = BS // S
    msb = -(-w.L // BS)
    max_pages = msb * ppb
    P = w.B * max_pages
    dt = np.dtype(w.dtype)
    bt = rng.permutation(P).astype(np.int32).reshape(w.B, max_pages)
    T = w.Tq_per_seq
    Tq = w.B * T
    cu = np.arange(w.B + 1, dtype=np.int32) * T
    q = rng.standard_normal((Tq, w.Hq, w.D), dtype=np.float32)
    lens = np.full(w.B, w.L, dtype=np.int32)
    # local block of query i: (L - T + i) // BS; the others: random distinct visible blocks
    i = np.tile(np.arange(T), w.B)
    local = (w.L - T + i) // BS if w.causal else np.full(Tq, msb - 1)
    n_vis = local + 1
    k_eff = min(w.topk, msb)
    sel = np.full((Tq, w.Hkv, w.topk), -1, dtype=np.int32)
    scores = rng.random((Tq, w.Hkv, msb))
    future = np.broadcast_to(np.arange(msb)[None, None, :] >= n_vis[:, None, None], scores.shape)
    scores[future] = -1.0  # wholly future blocks are never chosen
    scores[np.arange(Tq), :, local] = 2.0  # the local block is always chosen
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :k_eff]
    chosen = np.take_along_axis(scores, top, -1) >= 0
    sel[..., :k_eff] = np.where(chosen, top, -1)
    if fill == "all":
        k = rng.standard_normal((P, w.Hkv, S, w.D), dtype=np.float32).astype(dt)
        v = rng.standard_normal((P, w.Hkv, S, w.D), dtype=np.float32).astype(dt)
    else:
        k = np.zeros((P, w.Hkv, S, w.D), dtype=dt)
        v = np.zeros((P, w.Hkv, S, w.D), dtype=dt)
        b = np.repeat(np.arange(w.B), T)
        t_, h_, r_ = np.nonzero(sel >= 0)
        blocks = np.unique(np.stack([b[t_], sel[t_, h_, r_]], 1), axis=0)
        pages = np.unique(bt[blocks[:, :1], blocks[:, 1:] * ppb + np.arange(ppb)])
        shape = (pages.shape[0], w.Hkv, S, w.D)
        k[pages] = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        v[pages] = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    return dict(q=q, k_cache=k, v_cache=v, block_tables=bt, selected=sel, cu_seqlens_q=cu,
                used_kv_lens=lens, block_size=BS, causal=w.causal)
