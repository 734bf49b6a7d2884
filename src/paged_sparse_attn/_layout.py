"""The batch layout a plan is built from (R32), validated once: what stays fixed across layers.

A ``BatchLayout`` holds everything of a forward call except the per-layer tensors (``q``,
``k_cache``, ``v_cache``, ``selected`` and the index branch's ``index_q``, ``index_k_cache``):
the sequences (``cu_seqlens_q``, ``used_kv_lens``), the page map (``block_tables``), the shapes
and dtypes of the tensors, their page layout ``kv_layout`` (R34), ``block_size``, ``topk``,
``softmax_scale`` and ``causal``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._types import SeqLayout, _LayoutFacts
from ._validation import (
    FLOAT_DTYPES,
    NO_SELECTION,
    _fail,
    check_causal,
    check_int_array,
    check_kv_layout,
    check_layout,
    check_page_size,
    check_softmax_scale,
)

__all__ = ["BatchLayout", "validate_layout", "layout_of"]


def _positive(x, fn: str, name: str, rule: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or int(x) < 1:
        raise _fail(fn, f"{name} must be a positive int, got {x!r}", rule)
    return int(x)


def _dtype(x, fn: str, name: str) -> np.dtype:
    try:
        dt = np.dtype(x)
    except TypeError:
        raise _fail(fn, f"{name} must be a dtype, got {x!r}", "R7") from None
    if dt not in FLOAT_DTYPES:
        raise _fail(fn, f"{name} must be one of ({', '.join(d.name for d in FLOAT_DTYPES)}), got {dt.name}", "R7")
    return dt


@dataclass(frozen=True, eq=False)
class BatchLayout(_LayoutFacts):
    """A validated batch layout (R2-R5, R7, R8 checked once).

    Attributes
    ----------
    layout : SeqLayout
        The sequences and their pages (``block_tables``, ``cu_seqlens_q``, ``used_kv_lens`` with
        the R4 default filled in, ``block_size``, ``page_size``, ``causal``; they read through),
        the record the problems and indexes of the plan's calls share.
    num_q_heads, num_kv_heads, head_dim, topk : int
    kv_dtype : numpy.dtype
        dtype of ``k_cache`` and ``v_cache``.
    softmax_scale : float
    index_dim, num_index_heads : int or None
        The index branch's ``d_idx`` and ``Hk_idx`` (None: the plan runs attention only).
    index_dtype : numpy.dtype or None
    max_page : int
        Largest page id in ``block_tables`` (-1 if none): a cache must have more pages (R2).
    kv_layout : str
        ``"HND"`` or ``"NHD"``: the page layout of the caches and index keys (R34).
    """

    layout: SeqLayout
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: np.dtype
    topk: int
    softmax_scale: float
    index_dim: int | None = None
    num_index_heads: int | None = None
    index_dtype: np.dtype | None = None
    max_page: int = field(default=-1)
    kv_layout: str = "HND"

    def cache_shape(self, num_pages, heads: int | None = None, dim: int | None = None) -> tuple:
        """The shape of a cache of this layout: ``[P, H, S, d]`` (HND) or ``[P, S, H, d]`` (NHD)."""
        h = self.num_kv_heads if heads is None else heads
        d = self.head_dim if dim is None else dim
        return (num_pages, h, self.page_size, d) if self.kv_layout == "HND" else (num_pages, self.page_size, h, d)

    @property
    def num_queries(self) -> int:
        return self.layout.num_queries

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_queries_per_seq(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max(initial=0))

    def structure_key(self) -> tuple:
        """What a plan's buffers depend on: everything but the page map and the lengths, which a
        plan takes in ``update`` (the plan cache of ``forward()`` is keyed by it)."""
        return (self.block_tables.shape, self.cu_seqlens_q.tobytes(), self.block_size, self.page_size, self.num_q_heads,
                self.num_kv_heads, self.head_dim, self.kv_dtype, self.topk, self.softmax_scale,
                self.causal, self.index_dim, self.num_index_heads, self.index_dtype, self.kv_layout)


def validate_layout(fn: str, block_tables, cu_seqlens_q, used_kv_lens=None, *, block_size, page_size,
                    num_q_heads, num_kv_heads, head_dim, kv_dtype, topk, causal=False, softmax_scale=None,
                    index_dim=None, num_index_heads=None, index_dtype=None, kv_layout="HND") -> BatchLayout:
    """Check a batch layout once (R1-R5, R7, R8, R32, R34) and return it as a ``BatchLayout``."""
    kvl = check_kv_layout(kv_layout, fn)
    S = check_page_size(page_size, fn)
    Hq = _positive(num_q_heads, fn, "num_q_heads", "R1")
    Hkv = _positive(num_kv_heads, fn, "num_kv_heads", "R1")
    D = _positive(head_dim, fn, "head_dim", "R1")
    if Hq % Hkv:
        raise _fail(fn, f"num_q_heads={Hq} must be a multiple of num_kv_heads={Hkv}", "R1")
    if isinstance(topk, (bool, np.bool_)) or not isinstance(topk, (int, np.integer)) or int(topk) < 0:
        raise _fail(fn, f"topk must be an int >= 0, got {topk!r}", "R6")
    kdt = _dtype(kv_dtype, fn, "kv_dtype")
    cu = check_int_array(cu_seqlens_q, fn, "cu_seqlens_q", 1, "R3")
    Tq = int(cu[-1]) if cu.size else 0
    bt, cu, lens, _, bs = check_layout(fn, block_tables, cu, used_kv_lens, NO_SELECTION, block_size=block_size,
                                       page_size=S, num_pages=None, num_queries=Tq, num_kv_heads=Hkv)
    scale = check_softmax_scale(softmax_scale, D, fn)
    c = check_causal(causal, fn)
    idim = ihead = idt = None
    if index_dim is not None or num_index_heads is not None or index_dtype is not None:
        idim = _positive(index_dim, fn, "index_dim", "R21")
        ihead = 1 if num_index_heads is None else _positive(num_index_heads, fn, "num_index_heads", "R21")
        if ihead not in (1, Hkv):
            raise _fail(fn, f"num_index_heads must be 1 or num_kv_heads={Hkv}, got {ihead}", "R21")
        idt = kdt if index_dtype is None else _dtype(index_dtype, fn, "index_dtype")
    return BatchLayout(SeqLayout(bt, cu, lens, bs, S, c), Hq, Hkv, D, kdt, int(topk), scale, idim, ihead, idt,
                       int(bt.max(initial=-1)), kvl)


def layout_of(p, topk: int | None = None) -> BatchLayout:
    """The plan layout of a validated ``Problem`` (no new checks), sharing its ``SeqLayout``.

    ``topk`` defaults to the problem's; ``AttentionInputs`` (no selection yet) must pass it.
    """
    topk = p.topk if topk is None else topk
    return BatchLayout(p.layout, p.num_q_heads, p.num_kv_heads, p.head_dim, p.cache_dtype, topk, p.softmax_scale,
                       max_page=int(p.block_tables.max(initial=-1)), kv_layout=p.kv_layout)
