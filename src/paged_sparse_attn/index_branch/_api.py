"""The index branch's public functions: validate -> resolve backend -> check capabilities -> run."""

from __future__ import annotations

import dataclasses

import numpy as np

from .._api import check_capabilities, check_owner
from .._attention_plan import cached_plan
from .._layout import layout_of, validate_layout
from .._types import DeviceArray, Problem
from .._index import build_index_arrays
from .._outputs import backend_label, checked_out_lse, checked_scores, checked_selection

from .._validation import NO_SELECTION, cache_dims, check_cache_layout, check_float_array, check_kv_layout, validate_forward
from ..backends.base import Backend
from ..errors import UnsupportedError
from ..registry import resolve_backend
from ._types import IndexProblem, TopkProblem
from ._validation import check_topk, local_blocks, validate_block_scores, validate_select_topk

__all__ = ["block_scores", "select_topk", "sparse_attention"]


def _has_index_branch(backend: Backend, fn: str) -> None:
    """R18: the index branch runs only on a backend whose capabilities declare it."""
    if not backend.capabilities.index_branch:
        raise UnsupportedError(f"{fn}(): backend {backend_label(backend)} does not implement the index branch "
                               "(block_scores, select_topk): its capabilities say index_branch=False [R18]")


def _index_checks(backend: Backend, fn: str, p: IndexProblem) -> None:
    _has_index_branch(backend, fn)
    dev = check_owner(backend, fn, p.index_k_cache)
    check_capabilities(backend, fn, dtypes=(np.dtype(p.index_k_cache.dtype),),  # queries are widened exactly
                       head_dim=p.index_dim, page_size=p.page_size, block_size=p.block_size,
                       device_arrays=dev, kv_layout=p.kv_layout)


def block_scores(index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens=None, *, block_size,
                 softmax_scale=None, causal=True, kv_layout="HND", backend=None) -> np.ndarray:
    """Score every block for every (query, KV head): the max of its visible index logits (R22).

    Parameters
    ----------
    index_q : array [Tq, Hkv, d_idx], float32 or float16
        One index query per query and KV head.
    index_k_cache : array [P, Hk_idx, S, d_idx] (or [P, S, Hk_idx, d_idx] with ``kv_layout="NHD"``)
        Index keys, float32 or float16, paged like ``k_cache`` (same ``block_tables``); ``Hk_idx``
        is 1 (one index key head shared by every KV head, as in MSA) or ``Hkv``. May be a device
        array of the backend.
    block_tables : int array [B, max_pages]
        Physical page of each logical page, -1 = unmapped (R2).
    cu_seqlens_q : int array [B + 1]
        Query offsets of the sequences (R3).
    used_kv_lens : int array [B], optional
        KV length L_b of each sequence; default ``msb * block_size`` (R4).
    block_size : int
        Positive multiple of the page size (R5).
    softmax_scale : float, optional
        Multiplies every index logit; default ``1 / sqrt(d_idx)``.
    causal : bool
        Right-aligned causal visibility, as in R9. Default True, unlike ``forward()`` (R8).
    kv_layout : {"HND", "NHD"}
        Page layout of ``index_k_cache`` (R34).
    backend : str, Backend or None

    Returns
    -------
    ndarray float32 [Tq, Hkv, msb]
        ``max`` over the block's visible positions (mapped, ``< L_b`` and, with ``causal``,
        ``<= L_b - T_b + i``) of ``softmax_scale * index_q[t, h] . index_k[p]``; ``-inf`` for a
        block with no visible position; NaN if a visible logit is NaN.

    Raises
    ------
    SpecError
        An input violates R21 (or R2-R5, R7, R8, R34), before any backend work.
    UnsupportedError
        The backend does not implement the index branch or cannot run this problem (R18).
    """
    fn = "block_scores"
    p = validate_block_scores(fn, index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens,
                              block_size=block_size, softmax_scale=softmax_scale, causal=causal,
                              kv_layout=kv_layout)
    be = resolve_backend(backend, p.index_k_cache)
    _index_checks(be, fn, p)
    return checked_scores(be, fn, be.block_scores(p), (p.num_queries, p.num_kv_heads, p.msb))


def select_topk(scores, topk, *, force_local=True, cu_seqlens_q=None, used_kv_lens=None, block_size=None,
                backend=None) -> np.ndarray:
    """Exp-free top-k over block scores, optionally forcing each query's own block (R24).

    Parameters
    ----------
    scores : array [Tq, Hkv, msb], float32 (float16/bfloat16 widened exactly)
        Block scores, e.g. from [`block_scores`][paged_sparse_attn.index_branch.block_scores].
        float64 is refused (rounding it could create ties); cast it first.
    topk : int
        Slots per row, ``>= 0`` (``>= 1`` with ``force_local``). May exceed ``msb``.
    force_local : bool
        Put the block holding the query's own position ``L_b - T_b + i`` in slot 0 of every row
        (counted in ``topk``). A query with ``L_b - T_b + i < 0`` has no local block.
    cu_seqlens_q : int array [B + 1], required with ``force_local``
    used_kv_lens : int array [B], optional
        Default ``msb * block_size``.
    block_size : int, required with ``force_local``
    backend : str, Backend or None

    Returns
    -------
    ndarray int32 [Tq, Hkv, topk]
        Per row: the local block first (with ``force_local``), then the other blocks by
        descending score, ties to the lower block id; ``-1`` padding at the end. NaN and
        ``-inf`` scores are never selected (the forced local block excepted). Ids are unique
        per row, so the result is a valid ``selected`` for [`forward`][paged_sparse_attn.forward].

    Raises
    ------
    SpecError
        An input violates R23 (or R3-R5 for the sequence arguments).
    """
    fn = "select_topk"
    p = validate_select_topk(fn, scores, topk, force_local=force_local, cu_seqlens_q=cu_seqlens_q,
                             used_kv_lens=used_kv_lens, block_size=block_size)
    be = resolve_backend(backend)
    _has_index_branch(be, fn)
    return checked_selection(be, fn, be.select_topk(p), (p.num_queries, p.num_kv_heads, p.topk), p.msb)


def _sparse_planned(q, k_cache, v_cache, index_q, index_k_cache, block_tables, cu_seqlens_q, *, used_kv_lens,
                    block_size, topk, causal, softmax_scale, kv_layout, backend, return_lse):
    """``sparse_attention()`` with device-resident ``q`` or ``index_q`` (R30): through a cached plan."""
    fn = "sparse_attention"
    kv_layout = check_kv_layout(kv_layout, fn)
    qq = check_float_array(q, fn, "q", 3, allow_device=True)
    k = check_float_array(k_cache, fn, "k_cache", 4, allow_device=True)
    iq = check_float_array(index_q, fn, "index_q", 3, allow_device=True)
    ik = check_float_array(index_k_cache, fn, "index_k_cache", 4, allow_device=True)
    for x, name in ((k, "k_cache"), (ik, "index_k_cache")):
        check_cache_layout(x, fn, name, kv_layout)
    Tq, Hq, D = qq.shape
    _, Hkv, S, _ = cache_dims(k.shape, kv_layout)
    _, Hk, _, d_idx = cache_dims(ik.shape, kv_layout)
    lay = validate_layout(fn, block_tables, cu_seqlens_q, used_kv_lens, block_size=block_size, page_size=S,
                          num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, kv_dtype=k.dtype,
                          topk=check_topk(topk, fn, force_local=True), causal=causal, softmax_scale=softmax_scale,
                          index_dim=d_idx, num_index_heads=Hk, index_dtype=ik.dtype, kv_layout=kv_layout)
    be = resolve_backend(backend, qq, k, v_cache, iq, ik)
    return cached_plan(lay, be).run_sparse(qq, k, v_cache, iq, ik, return_lse=return_lse)


def sparse_attention(q, k_cache, v_cache, index_q, index_k_cache, block_tables, cu_seqlens_q, *,
                     used_kv_lens=None, block_size, topk, causal=True, softmax_scale=None, kv_layout="HND",
                     backend=None, return_lse=False):
    """MSA end to end: block scores -> top-k with the local block -> block-sparse attention (R25).

    Equivalent to::

        scores = block_scores(index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens,
                              block_size=block_size, causal=causal, backend=backend)
        selected = select_topk(scores, topk, force_local=True, cu_seqlens_q=cu_seqlens_q,
                               used_kv_lens=used_kv_lens, block_size=block_size, backend=backend)
        forward(q, k_cache, v_cache, block_tables, selected, cu_seqlens_q, used_kv_lens=used_kv_lens,
                block_size=block_size, softmax_scale=softmax_scale, causal=causal, backend=backend,
                return_lse=return_lse)

    with every input validated once, before any backend work, and all three steps on one backend.

    Parameters
    ----------
    q : array [Tq, Hq, D]
    k_cache, v_cache : array [P, Hkv, S, D] (or [P, S, Hkv, D] with ``kv_layout="NHD"``)
    index_q : array [Tq, Hkv, d_idx]
    index_k_cache : array [P, Hk_idx, S, d_idx] (or [P, S, Hk_idx, d_idx] with ``kv_layout="NHD"``)
        Paged like ``k_cache``: same ``P``, page size ``S`` and page layout; ``Hk_idx`` is 1 or
        ``Hkv``.
    block_tables, cu_seqlens_q, used_kv_lens, block_size
        As in [`forward`][paged_sparse_attn.forward].
    topk : int
        Blocks per (query, KV head), ``>= 1``, the local block included.
    causal : bool
        Used by both the block scores and the attention. Default True, unlike ``forward()`` (R8).
    softmax_scale : float, optional
        The attention's scale (default ``1 / sqrt(D)``); the block scores use ``1 / sqrt(d_idx)``.
    kv_layout : {"HND", "NHD"}
        Page layout of ``k_cache``, ``v_cache`` and ``index_k_cache`` (R34).
    backend : str, Backend or None
    return_lse : bool

    Returns
    -------
    out : ndarray float32 [Tq, Hq, D]
    lse : ndarray float32 [Tq, Hq]
        Only with ``return_lse=True``.
    """
    fn = "sparse_attention"
    if isinstance(q, DeviceArray) or isinstance(index_q, DeviceArray):  # R30: results stay on the device
        return _sparse_planned(q, k_cache, v_cache, index_q, index_k_cache, block_tables, cu_seqlens_q,
                               used_kv_lens=used_kv_lens, block_size=block_size, topk=topk, causal=causal,
                               softmax_scale=softmax_scale, kv_layout=kv_layout, backend=backend,
                               return_lse=return_lse)
    kvl = check_kv_layout(kv_layout, fn)
    q_ = check_float_array(q, fn, "q", 3)
    k_ = check_float_array(k_cache, fn, "k_cache", 4, allow_device=True)
    p = validate_forward(fn, q_, k_, v_cache, block_tables, NO_SELECTION, cu_seqlens_q,  # the selection comes later
                         used_kv_lens=used_kv_lens, block_size=block_size, softmax_scale=softmax_scale,
                         causal=causal, kv_layout=kvl)
    ip = validate_block_scores(fn, index_q, index_k_cache, p.block_tables, p.cu_seqlens_q, p.used_kv_lens,
                               block_size=p.block_size, softmax_scale=None, causal=p.causal, like=p)
    k = check_topk(topk, fn, force_local=True)
    be = resolve_backend(backend, p.k_cache, p.v_cache, ip.index_k_cache)
    dev = check_owner(be, fn, p.k_cache, p.v_cache)
    check_capabilities(be, fn, dtypes=(p.cache_dtype,), head_dim=p.head_dim,
                       page_size=p.page_size, block_size=p.block_size, device_arrays=dev, kv_layout=p.kv_layout)
    _index_checks(be, fn, ip)

    if be.plans_forward(p) and isinstance(ip.index_k_cache, DeviceArray):  # one submission per layer (R32)
        lay = dataclasses.replace(layout_of(p, topk=k), index_dim=ip.index_dim, num_index_heads=ip.num_index_heads,
                                  index_dtype=np.dtype(ip.index_k_cache.dtype))
        out, lse = checked_out_lse(be, fn, cached_plan(lay, be)._run_sparse(
            p.q_input, p.k_cache, p.v_cache, ip.index_q_input, ip.index_k_cache), p.q_input.shape)  # (as given: R7)
        return (out, lse) if return_lse else out
    scores = checked_scores(be, fn, be.block_scores(ip), (ip.num_queries, ip.num_kv_heads, ip.msb))
    tp = TopkProblem(scores=scores, topk=k, force_local=True,
                     local_block=local_blocks(p.cu_seqlens_q, p.used_kv_lens, p.block_size))
    selected = checked_selection(be, fn, be.select_topk(tp), (tp.num_queries, tp.num_kv_heads, tp.topk), tp.msb)
    p = Problem(p.q_input, p.k_cache, p.v_cache, p.layout, p.softmax_scale, selected, kv_layout=p.kv_layout)
    index = build_index_arrays(p.selected, p.layout)
    out, lse = checked_out_lse(be, fn, be.forward(p, index), p.q_input.shape)
    return (out, lse) if return_lse else out
