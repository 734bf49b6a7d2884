"""Plain data records shared by the API, the validation and the backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

import numpy as np

__all__ = [
    "IndexProblem",
    "TopkProblem",
    "Availability",
    "Capabilities",
    "KVOuterIndex",
    "Partials",
    "SeqLayout",
    "AttentionInputs",
    "Problem",
    "DeviceArray",
]


def _float32(x: np.ndarray) -> np.ndarray:
    """R7: a C-contiguous query array of any accepted float dtype, widened exactly to float32
    (float16 and bfloat16 values are all float32 values; a float32 array is returned as is)."""
    return x if x.dtype == np.float32 else np.ascontiguousarray(x, dtype=np.float32)


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here (the result of a probe, which never raises).

    Attributes
    ----------
    ok : bool
        True when the backend can be instantiated and run.
    reason : str
        What was found (``"ok: <device>"``) or, when ``ok`` is False, what to do about it.
    """

    ok: bool
    reason: str

    def __bool__(self) -> bool:  # so that ``if avail:`` reads naturally
        return self.ok


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as data (house rule: capabilities are data, not try/except).

    Attributes
    ----------
    dtypes : tuple of str
        Cache dtypes the backend runs (``k_cache``/``v_cache``, ``index_k_cache``), e.g.
        ``("float32", "float16")``. Queries (``q``, ``index_q``) of any R7 dtype reach every
        backend widened exactly to float32 (R7), so they are not listed.
    max_head_dim : int or None
        Largest head dimension D, None for no limit.
    max_page_size : int or None
        Largest page size S, None for no limit.
    max_block_size : int or None
        Largest block size BS, None for no limit.
    device_arrays : bool
        Whether the backend accepts device-resident caches
        ([`DeviceArray`][paged_sparse_attn.DeviceArray]).
    deterministic : bool
        Same bits for the same inputs on the same device, run after run (R19).
    batch_invariant : bool
        The bits of every output row depend only on that row's own inputs, not on the other
        sequences of the batch, their number or order, or the kernel chosen for the batch (R27).
    index_branch : bool
        The backend implements ``block_scores`` and ``select_topk`` (R21-R25); the API refuses
        the index branch on a backend without it (R18).
    kv_layouts : tuple of str
        Page layouts of the caches the backend reads (R34): ``"HND"`` ([P, Hkv, S, D]) and/or
        ``"NHD"`` ([P, S, Hkv, D]). The API refuses another layout with ``UnsupportedError``
        before calling the backend (R18). Default ``("HND",)``.
    features : frozenset of str
        Device features that matter (``"shader-f16"``, ``"subgroup"``, ``"timestamp-query"``,
        ``"subgroup-matrix"``, and one ``"subgroup-matrix-f16-MxNxK"`` per f16 x f16 -> f32
        subgroup-matrix configuration of the device).
    limits : mapping
        Device limits that matter (max storage binding, workgroup memory, ...).
    device : str
        Human-readable device description.
    """

    dtypes: tuple[str, ...] = ("float32", "float16")
    max_head_dim: int | None = None
    max_page_size: int | None = None
    max_block_size: int | None = None
    device_arrays: bool = False
    deterministic: bool = True
    batch_invariant: bool = False
    index_branch: bool = False
    kv_layouts: tuple[str, ...] = ("HND",)
    features: frozenset[str] = frozenset()
    limits: Mapping[str, int] = field(default_factory=dict)
    device: str = "cpu"


class DeviceArray:
    """Base class of arrays that live on a backend's device (e.g. an uploaded paged cache).

    Validation only needs ``shape`` and ``dtype``; the values stay on the device. ``forward()``
    accepts a DeviceArray wherever it accepts ``k_cache`` / ``v_cache``; the backend that owns it
    is used when ``backend=None``.

    Attributes
    ----------
    shape : tuple of int
    dtype : numpy.dtype
    backend : Backend
        The backend instance whose device holds the data.
    kv_layout : str
        Page layout of a cache held on the device (R34): ``"HND"`` (the default) or ``"NHD"``;
        a call must name the layout its device caches were uploaded in.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    backend: Any
    kv_layout: str = "HND"

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, eq=False)
class SeqLayout:
    """The sequences of a call and where their keys and values live (R2-R5, R9), validated.

    One record, shared: the [`Problem`][paged_sparse_attn.Problem] of a call and the
    [`KVOuterIndex`][paged_sparse_attn.KVOuterIndex] built from it hold the same ``SeqLayout``
    object, so each of these facts is stated once. Built only by the validation layer.

    Attributes
    ----------
    block_tables : ndarray int32 [B, max_pages]
        Physical page of every logical page, ``-1`` where none (R2).
    cu_seqlens_q : ndarray int32 [B + 1]
        Query offsets of the sequences (R3).
    used_kv_lens : ndarray int32 [B]
        ``L_b`` of every sequence, the R4 default ``msb * block_size`` filled in.
    block_size : int
        A positive multiple of ``page_size`` (R5).
    page_size : int
        ``S``, the positions per page.
    causal : bool
        Right-aligned causal mask (R9).
    """

    block_tables: np.ndarray  # [B, max_pages] int32
    cu_seqlens_q: np.ndarray  # [B+1] int32
    used_kv_lens: np.ndarray  # [B] int32
    block_size: int
    page_size: int
    causal: bool

    @property
    def num_seqs(self) -> int:
        """``B``."""
        return int(self.block_tables.shape[0])

    @property
    def num_queries(self) -> int:
        """``Tq = cu_seqlens_q[-1]``."""
        return int(self.cu_seqlens_q[-1]) if self.cu_seqlens_q.shape[0] else 0

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_size

    @property
    def msb(self) -> int:
        """Sparse blocks per sequence: ``max_pages // pages_per_block`` (R5)."""
        return int(self.block_tables.shape[1]) // self.pages_per_block


class _LayoutFacts:
    """Read-only views of a record's ``layout`` (a [`SeqLayout`][paged_sparse_attn.SeqLayout])."""

    layout: SeqLayout

    @property
    def block_tables(self) -> np.ndarray:
        """``layout.block_tables``, int32 [B, max_pages]."""
        return self.layout.block_tables

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        """``layout.cu_seqlens_q``, int32 [B + 1]."""
        return self.layout.cu_seqlens_q

    @property
    def used_kv_lens(self) -> np.ndarray:
        """``layout.used_kv_lens``, int32 [B] (the R4 default filled in)."""
        return self.layout.used_kv_lens

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def causal(self) -> bool:
        return self.layout.causal

    @property
    def num_seqs(self) -> int:
        return self.layout.num_seqs

    @property
    def pages_per_block(self) -> int:
        return self.layout.pages_per_block

    @property
    def msb(self) -> int:
        return self.layout.msb


@dataclass(frozen=True, eq=False)
class AttentionInputs(_LayoutFacts):
    """The validated tensors of one attention call over a [`SeqLayout`][paged_sparse_attn.SeqLayout].

    What a backend's [`forward_partials`][paged_sparse_attn.Backend.forward_partials] receives
    (its edges come from the index, whose ``layout`` is this record's ``layout``); a
    [`Problem`][paged_sparse_attn.Problem] adds the selection. Built only by the validation layer.
    ``q`` is a C-contiguous float32 array (widened exactly from any R7 dtype when first read, R7;
    ``q_input`` is the caller's array as given, for a backend that widens on its device), the caches are
    C-contiguous numpy arrays of an R7 dtype or [`DeviceArray`][paged_sparse_attn.DeviceArray]
    handles of the backend. The layout's fields read through: ``block_tables``,
    ``cu_seqlens_q``, ``used_kv_lens``, ``block_size``, ``page_size``, ``causal``, ``num_seqs``
    B, ``pages_per_block``, ``msb``. Derived sizes: ``num_queries`` Tq, ``num_q_heads`` Hq,
    ``head_dim`` D, ``num_pages`` P, ``num_kv_heads`` Hkv, ``group_size`` G = Hq // Hkv (query
    head ``hq`` reads KV head ``hq // G``, R1), ``cache_dtype``.

    Attributes
    ----------
    q_input : ndarray [Tq, Hq, D]
        Queries as the caller gave them: float32, float16 or bfloat16, C-contiguous (R7).
    q : ndarray [Tq, Hq, D]
        Queries, float32: ``q_input`` widened exactly, once, when first read (a property; a
        backend that widens a float16 ``q_input`` on its device never pays the host's widening).
    k_cache, v_cache : ndarray or DeviceArray [P, Hkv, S, D] or [P, S, Hkv, D]
        The paged caches, float32, float16 or bfloat16, of one dtype, in ``kv_layout``.
    layout : SeqLayout
        The sequences and their pages (``page_size`` is ``S`` of the caches).
    softmax_scale : float
        Already defaulted to ``1 / sqrt(D)``.
    kv_layout : str
        ``"HND"`` (caches ``[P, Hkv, S, D]``) or ``"NHD"`` (``[P, S, Hkv, D]``), R34; one of the
        backend's ``capabilities.kv_layouts``. Keyword-only, default ``"HND"``.
    """

    q_input: np.ndarray  # [Tq, Hq, D], the caller's dtype
    k_cache: Any  # [P, Hkv, S, D]
    v_cache: Any  # [P, Hkv, S, D]
    layout: SeqLayout
    softmax_scale: float
    kv_layout: str = field(default="HND", kw_only=True)  # R34

    @cached_property
    def q(self) -> np.ndarray:
        """``q_input`` widened exactly to float32 (R7), C-contiguous; made on first read."""
        return _float32(self.q_input)

    @property
    def num_queries(self) -> int:
        return self.q_input.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.q_input.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q_input.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[1 if self.kv_layout == "HND" else 2]

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def cache_dtype(self) -> np.dtype:
        return np.dtype(self.k_cache.dtype)


@dataclass(frozen=True, eq=False)
class Problem(AttentionInputs):
    """A validated forward problem (R1-R8): [`AttentionInputs`][paged_sparse_attn.AttentionInputs]
    and the selection. Built only by the validation layer.

    What a backend's [`forward`][paged_sparse_attn.Backend.forward] and
    [`plans_forward`][paged_sparse_attn.Backend.plans_forward] receive. Every field and size
    of ``AttentionInputs`` (the layout's fields read through), plus ``topk``.

    Attributes
    ----------
    selected : ndarray int32 [Tq, Hkv, topk]
        Block ids per (query, KV head), ``-1`` padding (R6).
    """

    selected: np.ndarray  # [Tq, Hkv, topk] int32

    @property
    def topk(self) -> int:
        return self.selected.shape[2]


@dataclass(frozen=True, eq=False)
class KVOuterIndex(_LayoutFacts):
    """The inverted selection of R13: one edge per kept ``(t, h, rank)`` entry of ``selected``.

    Edges are ordered by KV head ``h``, then slot ``(b, s)`` ascending, then query ``t``
    ascending, so all queries that chose one block are adjacent (a *slot group*) and the block's
    K/V can be loaded once for all of them and all G query heads of the group.

    All arrays are int32 and C-contiguous. E = number of edges, n_slots = number of slot groups.

    Attributes
    ----------
    edge_query : ndarray [E]
        Packed query index t of each edge.
    edge_head : ndarray [E]
        KV head h.
    edge_seq : ndarray [E]
        Sequence b of the query.
    edge_block : ndarray [E]
        Sparse block id s.
    edge_rank : ndarray [E]
        Slot position of the edge in ``selected[t, h, :]``.
    edge_len : ndarray [E]
        Number of leading positions of the block the edge may attend, in ``[1, block_size]``:
        ``min(block_size, hi_t - s * block_size)`` with ``hi_t = L_b`` (or, causal,
        ``min(L_b, L_b - T_b + i + 1)``). Unmapped pages inside that range are still skipped.
    slot_ptr : ndarray [n_slots + 1]
        Edges of slot group g are ``slot_ptr[g]:slot_ptr[g+1]``.
    slot_head, slot_seq, slot_block : ndarray [n_slots]
        The (h, b, s) of each slot group.
    row_ptr : ndarray [Tq * Hkv + 1]
        Edges of row ``r = t * Hkv + h`` are ``row_edges[row_ptr[r]:row_ptr[r+1]]``, in rank order.
    row_edges : ndarray [E]
        Edge ids grouped by row (the inverse view used by the combine, R15).
    layout : SeqLayout
        The validated layout the index was built from (kernels need the page map): the same
        record as the problem's. Its fields read through: ``block_tables``, ``cu_seqlens_q``,
        ``used_kv_lens`` (the R4 default filled in), ``block_size``, ``page_size``, ``causal``,
        ``num_seqs``, ``pages_per_block``, ``msb``.
    num_queries, num_kv_heads : int
        Tq and Hkv of the selection the index inverts (``row_ptr`` has ``Tq * Hkv + 1`` entries).

    The same fields, in the same words, are the R13 table of the spec
    (docs/spec/partials-and-combine.md).
    """

    edge_query: np.ndarray
    edge_head: np.ndarray
    edge_seq: np.ndarray
    edge_block: np.ndarray
    edge_rank: np.ndarray
    edge_len: np.ndarray
    slot_ptr: np.ndarray
    slot_head: np.ndarray
    slot_seq: np.ndarray
    slot_block: np.ndarray
    row_ptr: np.ndarray
    row_edges: np.ndarray
    layout: SeqLayout
    num_queries: int
    num_kv_heads: int

    @property
    def num_edges(self) -> int:
        return int(self.edge_query.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.slot_head.shape[0])

    def edge_rows(self) -> np.ndarray:
        """Row id ``t * Hkv + h`` of every edge, shape [E]."""
        return self.edge_query.astype(np.int64) * self.num_kv_heads + self.edge_head


@dataclass(frozen=True, eq=False)
class Partials:
    """Per-(edge, query head in group) online-softmax partials (R14).

    Attributes
    ----------
    o : ndarray float32 [E, G, D]
        Unnormalised ``sum exp(score - m) v``.
    m : ndarray float32 [E, G]
        Max scaled score over the edge's attended positions; ``-inf`` if it attends nothing.
    l : ndarray float32 [E, G]
        ``sum exp(score - m)``; 0 if the edge attends nothing.
    """

    o: np.ndarray
    m: np.ndarray
    l: np.ndarray  # noqa: E741  (the paper's name)


# --- the index branch's problems (R21-R25) ------------------------------------------------------

@dataclass(frozen=True, eq=False)
class IndexProblem:
    """A validated [`block_scores`][paged_sparse_attn.index_branch.block_scores] problem (R21, R22).

    Attributes
    ----------
    index_q_input : ndarray [Tq, Hkv, d_idx]
        The index queries as the caller gave them: float32, float16 or bfloat16, C-contiguous (R7).
    index_q : ndarray float32 [Tq, Hkv, d_idx]
        ``index_q_input`` widened exactly to float32, once, when first read (a property, R7).
    index_k_cache : ndarray or DeviceArray [P, Hk_idx, S, d_idx] or [P, S, Hk_idx, d_idx]
        Paged index keys, ``Hk_idx`` is 1 (shared by every KV head) or ``Hkv``.
    block_tables : ndarray int32 [B, max_pages]
    cu_seqlens_q : ndarray int32 [B + 1]
    used_kv_lens : ndarray int32 [B]
        ``L_b`` of every sequence (the default already filled in).
    query_seq : ndarray int32 [Tq]
        Sequence ``b`` of every query.
    query_end : ndarray int32 [Tq]
        Exclusive end of the positions query ``t`` may see: ``L_b``, or with ``causal``
        ``min(L_b, L_b - T_b + i + 1)``; ``<= 0`` when it sees nothing.
    block_size : int
    softmax_scale : float
        Already defaulted to ``1 / sqrt(d_idx)``.
    causal : bool
    kv_layout : str
        ``"HND"`` (``index_k_cache`` ``[P, Hk_idx, S, d_idx]``) or ``"NHD"``
        (``[P, S, Hk_idx, d_idx]``), R34.
    """

    index_q_input: np.ndarray  # the caller's dtype
    index_k_cache: Any
    block_tables: np.ndarray
    cu_seqlens_q: np.ndarray
    used_kv_lens: np.ndarray
    query_seq: np.ndarray
    query_end: np.ndarray
    block_size: int
    softmax_scale: float
    causal: bool
    kv_layout: str = "HND"  # R34

    @cached_property
    def index_q(self) -> np.ndarray:
        """``index_q_input`` widened exactly to float32 (R7), C-contiguous; made on first read."""
        return _float32(self.index_q_input)

    @property
    def num_queries(self) -> int:
        return int(self.index_q_input.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.index_q_input.shape[1])

    @property
    def index_dim(self) -> int:
        return int(self.index_q_input.shape[2])

    @property
    def num_index_heads(self) -> int:
        """``Hk_idx``: 1 (one index key head shared by every KV head) or ``Hkv``."""
        return int(self.index_k_cache.shape[1 if self.kv_layout == "HND" else 2])

    @property
    def num_pages(self) -> int:
        return int(self.index_k_cache.shape[0])

    @property
    def page_size(self) -> int:
        return int(self.index_k_cache.shape[2 if self.kv_layout == "HND" else 1])

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_size

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def msb(self) -> int:
        return int(self.block_tables.shape[1]) // self.pages_per_block


@dataclass(frozen=True, eq=False)
class TopkProblem:
    """A validated [`select_topk`][paged_sparse_attn.index_branch.select_topk] problem (R23, R24).

    Attributes
    ----------
    scores : ndarray float32 [Tq, Hkv, msb]
        C-contiguous; NaN, ``-inf`` and ``+inf`` allowed (R24 says what they mean).
    topk : int
        Slots per row, ``>= 0`` (``>= 1`` with ``force_local``).
    local_block : ndarray int32 [Tq]
        Block forced into slot 0 of every row of query ``t``, ``-1`` for none (always ``-1``
        without ``force_local``). Every id is in ``[0, msb)``.
    force_local : bool
    """

    scores: np.ndarray
    topk: int
    local_block: np.ndarray
    force_local: bool

    @property
    def num_queries(self) -> int:
        return int(self.scores.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.scores.shape[1])

    @property
    def msb(self) -> int:
        return int(self.scores.shape[2])
