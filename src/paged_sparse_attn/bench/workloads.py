"""Benchmark workloads (names and geometries) and their problems, made by
``testing.generate.msa_problem``: random paged caches with MSA selections (local block always chosen)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..testing.generate import msa_problem

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


def make_problem(w: Workload, seed: int = 0, fill: str = "all") -> dict:
    """Random problem for workload ``w`` (``testing.generate.msa_problem``): scrambled physical
    pages, the local block and a random top-k of visible blocks.

    ``fill="selected"`` draws random values only for the pages some query selects and leaves
    the others zero (they are never read; this keeps very large caches cheap to build).

    Returns
    -------
    dict
        Arguments of :func:`paged_sparse_attn.forward` (``q, k_cache, v_cache, block_tables,
        selected, cu_seqlens_q, used_kv_lens, block_size, softmax_scale, causal``).
    """
    return msa_problem(B=w.B, L=w.L, Tq_per_seq=w.Tq_per_seq, Hq=w.Hq, Hkv=w.Hkv, D=w.D, page_size=w.page_size,
                       block_size=w.block_size, topk=w.topk, causal=w.causal, dtype=w.dtype, seed=seed,
                       fill=fill).kwargs()
