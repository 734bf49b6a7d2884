"""Host-side planning for the wgpu kernels: work items, cache chunks, merge segments, batches.

Pure numpy, vectorised (no Python loop over edges); nothing here touches the device.

Vocabulary
----------
slab
    One (page, KV head) of a cache: ``S * D`` elements. A cache on the device is a sequence of
    slabs (global slab id ``p * Hkv + h``, or a compact renumbering of the slabs a problem reads);
    it is cut into *chunks* of whole slabs, one storage binding each. A whole ``"NHD"`` cache
    (R34) is held as it is: the ``Hkv`` slabs of a page share its memory, their rows interleaved,
    and chunks are whole pages, so a slab's device number still is ``page * Hkv + h`` within its
    chunk and only the kernels' row addressing differs (override ``RH``).
work item
    Up to ``RMAX`` rows reading one KV block: consecutive edges of one slot group times the G
    query heads of the group (or one edge times a range of heads when ``G > RMAX``).
item-chunk
    A work item paired with one chunk its block's pages lie in; one workgroup each. Pages in
    other chunks are INVALID in the item-chunk's page list.
partial row ("prow")
    The (o, m, l) one item-chunk computes for one (edge, head): a piece of an edge's partial.
segment
    The partial rows merged into one destination: an edge's pieces (forward_partials) or all
    pieces of all edges of a (query, KV head) row (the combine of forward).
batch
    A set of rows (forward) or edges (forward_partials) whose buffers fit the binding limit; the
    batches of a call run in one command encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..._index import run_starts
from ..._types import KVOuterIndex
from ...errors import UnsupportedError

__all__ = [
    "INVALID",
    "ITEM_WORDS",
    "Geometry",
    "workgroup_bytes",
    "choose_geometry",
    "SlabMap",
    "IndexView",
    "BatchPlan",
    "plan_forward",
    "plan_partials",
    "grid_dispatches",
    "partials_grid",
    "unique_sorted",
    "unique_inverse",
]

INVALID = 0xFFFFFFFF
ITEM_WORDS = 8
MAX_RMAX = 256
MAX_TK = 64


def unique_sorted(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for an integer array, by one sort: numpy 2's hash-based ``np.unique``
    took 0.57 ms where this takes 0.05 ms on 4096 keys (a decode step's page keys)."""
    s = np.sort(a)
    return s[run_starts(s)]


def unique_inverse(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True)`` for an integer array, by one argsort."""
    order = np.argsort(a, kind="stable")
    s = a[order]
    new = run_starts(s)
    inv = np.empty(a.shape[0], dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return s[new], inv


def _excl_cumsum(a: np.ndarray) -> np.ndarray:
    out = np.zeros(a.shape[0] + 1, dtype=np.int64)
    np.cumsum(a, out=out[1:])
    return out


# --- kernel geometry ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """Specialisation of the partials kernel (its override constants) and the item shape.

    RMAX rows per work item, TK keys per tile. In the P.V phase each invocation owns a 4 x 4
    register tile: rows ``tr + a * TR`` and dims ``td + b * TD`` (a, b < 4), with
    ``TD = ceil(D / 4)`` invocations along d and ``TR = WG // TD`` along rows.
    """

    D: int
    S: int
    G: int
    TK: int
    RMAX: int
    WG: int
    TD: int
    kv_itemsize: int

    @property
    def kernel_name(self) -> str:
        """The partials kernel of this geometry (subclasses name theirs in ``kernel``)."""
        return getattr(self, "kernel", "psa_partials.wgsl")

    @property
    def KS(self) -> int:
        return self.D + 1 - (self.D & 1)

    @property
    def TR(self) -> int:
        return self.WG // self.TD

    @property
    def heads_per_item(self) -> int:
        return min(self.G, self.RMAX)

    @property
    def head_splits(self) -> int:
        return -(-self.G // self.heads_per_item)

    @property
    def edges_per_item(self) -> int:
        return max(1, self.RMAX // self.G) if self.G <= self.RMAX else 1

    @property
    def workgroup_bytes(self) -> int:
        return workgroup_bytes(self.D, self.TK, self.RMAX, self.TD, self.kv_itemsize, self.WG)

    @property
    def max_workgroups(self) -> int | None:
        """Workgroups a dispatch of the kernel needs at most, whatever its item count (a kernel
        whose workgroups loop over items), or None: one workgroup per item."""
        return None

    def constants(self) -> dict[str, int]:
        return {"D": self.D, "S": self.S, "TK": self.TK, "RMAX": self.RMAX, "WG": self.WG, "TD": self.TD}


def workgroup_bytes(D: int, TK: int, RMAX: int, TD: int, kv_itemsize: int, WG: int = 64) -> int:
    """Workgroup memory of psa_partials.wgsl for these constants (each array rounded to 16 bytes)."""
    KS = D + 1 - (D & 1)
    NRG = -(-RMAX // 4)
    PS = TK + 1 - (TK & 1)
    QS = NRG | 1

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    return (a(QS * D * 16) + a(TK * KS * kv_itemsize) + a(TK * TD * 4 * kv_itemsize)
            + a(NRG * 4 * PS * 4) + a(2 * TK * 4) + 4 * a(RMAX * 4) + 3 * a(WG * 4))


def choose_geometry(*, D: int, S: int, G: int, block_size: int, rows_needed: int, kv_itemsize: int,
                    wg_size: int, wg_storage: int, max_tk: int = MAX_TK, max_rmax: int = MAX_RMAX) -> Geometry:
    """Largest tile that fits the device's workgroup memory (checked here: wgpu does not).

    ``rows_needed`` is rounded up to a power of two: RMAX is a pipeline constant, and a value per
    selection pattern would compile (and cache) a new pipeline for nearly every call.
    """
    rows_needed = 1 << max(0, int(rows_needed) - 1).bit_length()
    TD = -(-D // 4)
    if TD > wg_size:
        raise UnsupportedError(f"backend 'wgpu': head_dim {D} needs a workgroup size >= {TD} [R18]")
    TR = wg_size // TD
    rmax = max(1, min(max_rmax, MAX_RMAX, 4 * TR, wg_size, rows_needed))  # softmax: a row per invocation at least
    tk = max(1, min(max_tk, block_size))

    def size(tk: int, rmax: int) -> int:
        return workgroup_bytes(D, tk, rmax, TD, kv_itemsize, wg_size)

    while size(tk, rmax) > wg_storage:
        if tk > 8:
            tk = (tk + 1) // 2
        elif rmax > 1:
            rmax = (rmax + 1) // 2
        elif tk > 1:
            tk = (tk + 1) // 2
        else:
            raise UnsupportedError(
                f"backend 'wgpu': head_dim {D} needs {size(1, 1)} bytes of workgroup memory, the "
                f"device allows {wg_storage} [R18]")
    return Geometry(D=D, S=S, G=G, TK=tk, RMAX=rmax, WG=wg_size, TD=TD, kv_itemsize=kv_itemsize)


# --- slabs and chunks --------------------------------------------------------------------------

@dataclass(frozen=True)
class SlabMap:
    """How global slab ids ``p * Hkv + h`` map to the device cache's chunks.

    ``slab_ids`` is None when the device cache holds every slab in order (a resident cache), else
    the sorted global ids of the slabs it holds (a compact upload); ``chunk_starts`` [n_chunks+1]
    are chunk boundaries in the device's slab numbering.
    """

    chunk_starts: np.ndarray
    slab_ids: np.ndarray | None = None

    @property
    def n_chunks(self) -> int:
        return int(self.chunk_starts.shape[0]) - 1

    def to_device(self, gslab: np.ndarray) -> np.ndarray:
        if self.slab_ids is None:
            return gslab
        return np.searchsorted(self.slab_ids, gslab)

    def chunk_of(self, dslab: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.chunk_starts, dslab, side="right") - 1


def chunk_starts_for(n_slabs: int, slab_bytes: int, binding_size: int, unit: int = 1) -> np.ndarray:
    """Boundaries of chunks of whole slabs, each at most ``binding_size`` bytes.

    ``unit``: slabs that must stay in one chunk, a multiple of it per chunk (an NHD page holds the
    rows of its ``Hkv`` slabs interleaved, R34: chunks are whole pages).
    """
    per = (binding_size // slab_bytes) // unit * unit
    if per < 1:
        what = "(page, KV head)" if unit == 1 else f"page ({unit} KV heads, kv_layout='NHD')"
        raise UnsupportedError(
            f"backend 'wgpu': one {what} of the cache takes {slab_bytes * unit} bytes, more than the "
            f"storage binding limit {binding_size} [R18]")
    starts = np.arange(0, max(n_slabs, 1), per, dtype=np.int64)
    return np.append(starts, n_slabs).astype(np.int64)


# --- index view --------------------------------------------------------------------------------

class IndexView:
    """Per-edge / per-slot arrays of a KVOuterIndex in the forms the planner needs (int64).

    The arrays are made on first use: a call uses only some of them (a decode step on one cache
    chunk needs no edge ranks, no slot of each edge, ...), and each costs a pass over the edges.
    """

    def __init__(self, index: KVOuterIndex, G: int):
        self.index = index
        self.G = G
        self.Hkv = index.num_kv_heads
        self.S = index.page_size
        self.ppb = index.pages_per_block
        self.E = index.num_edges
        self.bt = index.block_tables
        self.slot_ptr = index.slot_ptr.astype(np.int64)
        self.slot_counts = np.diff(self.slot_ptr)
        self.max_slot_edges = int(self.slot_counts.max()) if self.slot_counts.size else 0

    @cached_property
    def slot_of_edge(self) -> np.ndarray:
        return np.repeat(np.arange(self.index.num_slots, dtype=np.int64), self.slot_counts)

    @cached_property
    def edge_len(self) -> np.ndarray:
        return self.index.edge_len.astype(np.int64)

    @cached_property
    def edge_row(self) -> np.ndarray:
        return self.index.edge_rows()

    @cached_property
    def edge_rank(self) -> np.ndarray:
        return self.index.edge_rank.astype(np.int64)

    @cached_property
    def slot_h(self) -> np.ndarray:
        return self.index.slot_head.astype(np.int64)

    @cached_property
    def slot_b(self) -> np.ndarray:
        return self.index.slot_seq.astype(np.int64)

    @cached_property
    def slot_s(self) -> np.ndarray:
        return self.index.slot_block.astype(np.int64)

    @cached_property
    def slot_maxlen(self) -> np.ndarray:
        """Longest edge of each slot group (the positions its block is read up to)."""
        if not self.E:
            return np.zeros(0, dtype=np.int64)
        if self.max_slot_edges == 1:  # one edge per slot (decode): the edge lengths themselves
            return self.edge_len
        return np.maximum.reduceat(self.edge_len, self.slot_ptr[:-1])

    def slot_pages(self, slots: np.ndarray | None, maxlen: np.ndarray):
        """Pages read by blocks ``slots`` (None: every slot) up to ``maxlen`` positions.

        Returns ``(npg, off, gslab)``: pages per slot, their offsets (exclusive cumsum) and the
        global slab (``page * Hkv + head``, or -1 for an unmapped page) of each, slot-major.
        """
        npg = (maxlen + self.S - 1) // self.S
        off = _excl_cumsum(npg)
        h, b, s = (self.slot_h, self.slot_b, self.slot_s) if slots is None else \
            (self.slot_h[slots], self.slot_b[slots], self.slot_s[slots])
        # every slot's block as a row of ppb pages (in range of bt: s < msb), cut to npg pages;
        # a boolean mask compresses row-major, i.e. slot-major then page order
        j = np.arange(self.ppb, dtype=np.int64)
        p = np.take(self.bt.reshape(-1), (b * self.bt.shape[1] + s * self.ppb)[:, None] + j).astype(np.int64)
        gslab = np.where(p >= 0, p * self.Hkv + h[:, None], -1)
        if int(off[-1]) != gslab.size:
            gslab = gslab[j < npg[:, None]]
        return npg, off, gslab.reshape(-1)

    def needed_slabs(self) -> np.ndarray:
        """Sorted global ids of every slab some edge reads (for compact uploads)."""
        if not self.E:
            return np.zeros(0, dtype=np.int64)
        _, _, gslab = self.slot_pages(None, self.slot_maxlen)
        return unique_sorted(gslab[gslab >= 0])

    def chunks_per_slot(self, smap: SlabMap) -> np.ndarray:
        """Distinct chunks each slot group's block touches (at least 1)."""
        n = self.index.num_slots
        if smap.n_chunks <= 1 or n == 0:
            return np.ones(n, dtype=np.int64)
        npg, _, gslab = self.slot_pages(None, self.slot_maxlen)
        owner = np.repeat(np.arange(n, dtype=np.int64), npg)
        ok = gslab >= 0
        ch = smap.chunk_of(smap.to_device(gslab[ok]))
        key = unique_sorted(owner[ok] * smap.n_chunks + ch)
        return np.maximum(1, np.bincount(key // smap.n_chunks, minlength=n))


# --- plans -------------------------------------------------------------------------------------

@dataclass
class BatchPlan:
    """Everything one batch uploads and dispatches.

    Partial rows come in groups of G (one group per (edge, cache chunk) piece): partial row
    ``group * G + g`` is head g of the piece.

    ``plan_words`` (u32): item-chunk records | edge records | page lists (psa_partials.wgsl).
    ``dispatches``: (chunk, first item-chunk, count) for the partials kernel.
    ``merge_words`` (u32) or None: ptr [n_dest / G + 1] | group ids, for psa_merge.wgsl: the
    destinations ``j*G .. j*G+G-1`` share the group list ``ptr[j]:ptr[j+1]``. None when the
    partial rows already are the destinations (``identity``).
    ``q_rows``: global q rows (``t * Hkv + h``) to upload, in local order; or a slice.
    ``dest``: slice of the global destination rows this batch writes.
    """

    plan_words: np.ndarray
    dispatches: list
    n_prows: int
    identity: bool
    merge_words: np.ndarray | None
    n_dest: int
    q_rows: object
    dest: slice
    group_size: int

    @property
    def elem_off(self) -> int:
        return self.n_dest // self.group_size + 1


def _items(view: IndexView, geom: Geometry, smap: SlabMap, eids: np.ndarray, lrow: np.ndarray,
           full: bool = False) -> dict:
    """Work items, item-chunks, page lists and partial-row groups for the edges ``eids``.

    ``full``: ``eids`` is every edge in order (``arange(E)``), so slot-level arrays apply as is.
    """
    G = geom.G
    E = eids.shape[0]
    if full and view.max_slot_edges <= geom.edges_per_item:
        # every slot group is one edge-item (always so for decode): no per-edge run analysis
        e_start = view.slot_ptr[:-1]
        e_ne = view.slot_counts
        e_max = view.slot_maxlen
        e_slot = None  # = arange(n_slots)
        lens = view.edge_len
    else:
        sl = view.slot_of_edge[eids]
        lens = view.edge_len[eids]
        new_run = np.ones(E, dtype=bool)
        new_run[1:] = sl[1:] != sl[:-1]
        run_start = np.flatnonzero(new_run)
        run_id = np.cumsum(new_run) - 1
        pos = np.arange(E, dtype=np.int64) - run_start[run_id]
        new_item = new_run | (pos % geom.edges_per_item == 0)
        e_start = np.flatnonzero(new_item).astype(np.int64)  # per edge-item: first local edge
        e_ne = np.diff(np.append(e_start, E))
        e_max = np.maximum.reduceat(lens, e_start)
        e_slot = sl[e_start]
    nh, ngmax = geom.head_splits, geom.heads_per_item
    n_eitems = e_start.shape[0]
    if nh > 1:  # item = (edge-item, head range); items of one edge-item are consecutive
        if e_slot is None:
            e_slot = np.arange(n_eitems, dtype=np.int64)
        istart, ine, imax, islot = (np.repeat(a, nh) for a in (e_start, e_ne, e_max, e_slot))
        ig0 = np.tile(np.arange(nh, dtype=np.int64) * ngmax, n_eitems)
        ing = np.minimum(ngmax, G - ig0)
    else:
        istart, ine, imax, islot = e_start, e_ne, e_max, e_slot
        ig0 = None  # = 0: every item holds heads 0..G-1
    n_items = istart.shape[0]

    npg, pg_off, gslab = view.slot_pages(islot, imax)
    ok = gslab >= 0
    if smap.slab_ids is None:
        dslab = gslab  # -1 where unmapped
    else:
        dslab = np.full(gslab.shape[0], -1, dtype=np.int64)
        dslab[ok] = smap.to_device(gslab[ok])
    nc = smap.n_chunks
    if nc == 1:
        ic_item = None  # = arange(n_items): item-chunk i is item i
        ic_chunk = np.zeros(n_items, dtype=np.int64)
        cs0 = int(smap.chunk_starts[0])
        pages = dslab if cs0 == 0 else np.where(ok, dslab - cs0, INVALID)  # unmapped: -1 = INVALID as u32
        icpg_off = pg_off
    else:  # one item-chunk per chunk the item's readable pages lie in; none if it has none
        owner = np.repeat(np.arange(n_items, dtype=np.int64), npg)
        chunk = np.full(gslab.shape[0], -1, dtype=np.int64)
        chunk[ok] = smap.chunk_of(dslab[ok])
        key = unique_sorted(owner[ok] * nc + chunk[ok])
        ic_item, ic_chunk = key // nc, key % nc
        order = np.argsort(ic_chunk, kind="stable")
        ic_item, ic_chunk = ic_item[order], ic_chunk[order]
        ic_npg = npg[ic_item]
        icpg_off = _excl_cumsum(ic_npg)
        icx = np.repeat(np.arange(ic_item.shape[0], dtype=np.int64), ic_npg)
        src = pg_off[ic_item[icx]] + (np.arange(int(icpg_off[-1]), dtype=np.int64) - icpg_off[icx])
        same = chunk[src] == ic_chunk[icx]
        rel = dslab[src] - smap.chunk_starts[np.maximum(chunk[src], 0)]
        pages = np.where(same, rel, INVALID)
    n_ic = n_items if ic_item is None else ic_item.shape[0]

    def per_ic(a: np.ndarray) -> np.ndarray:
        return a if ic_item is None else a[ic_item]

    # partial-row groups: one per (edge, chunk) piece; with one chunk, group = local edge
    if nc == 1:
        group0 = istart
        n_groups = E
        group_le = group_chunk = None
    else:
        ic_eitem = ic_item // nh
        pkey, pinv = unique_inverse(ic_eitem * nc + ic_chunk)
        p_eitem = pkey // nc
        p_ne = e_ne[p_eitem]
        pbase = _excl_cumsum(p_ne)
        group0 = pbase[:-1][pinv.reshape(-1)]
        n_groups = int(pbase[-1])
        pog = np.repeat(np.arange(pkey.shape[0], dtype=np.int64), p_ne)
        group_le = e_start[p_eitem[pog]] + (np.arange(n_groups, dtype=np.int64) - pbase[pog])
        group_chunk = (pkey % nc)[pog]

    # the words, written in place as u32 (values wrap like astype(uint32): INVALID = -1)
    erec_base = n_ic * ITEM_WORDS
    page_base = erec_base + 2 * E
    words = np.empty(page_base + pages.shape[0], dtype=np.uint32)
    items = words[:erec_base].reshape(n_ic, ITEM_WORDS)
    items[:, 0] = per_ic(imax)
    items[:, 1] = per_ic(ine)
    if ig0 is None:
        items[:, 2] = 0
        items[:, 3] = G
        items[:, 6] = group0 * G
    else:
        items[:, 2] = per_ic(ig0)
        items[:, 3] = per_ic(ing)
        items[:, 6] = group0 * G + per_ic(ig0)
    items[:, 4] = erec_base + 2 * per_ic(istart)
    items[:, 5] = page_base + icpg_off[:n_ic]
    items[:, 7:] = 0
    erec = words[erec_base:page_base].reshape(E, 2)
    erec[:, 0] = lrow
    erec[:, 1] = lens
    words[page_base:] = pages

    dispatches = []
    if n_ic:
        if nc == 1:
            dispatches = [(0, 0, n_ic)]
        else:
            bounds = np.flatnonzero(np.diff(ic_chunk)) + 1
            starts = np.concatenate([[0], bounds])
            ends = np.concatenate([bounds, [n_ic]])
            dispatches = [(int(ic_chunk[a]), int(a), int(b - a)) for a, b in zip(starts, ends)]
    return dict(words=words, dispatches=dispatches, n_prows=n_groups * G, identity=nc == 1,
                group_le=group_le, group_chunk=group_chunk)


def _batches(costs: list[np.ndarray], caps: list[int], names: list[str], what: str,
             binding: int, unit_bytes: list[int]) -> list[tuple[int, int]]:
    """Greedy split of units 0..n-1 into ranges whose summed costs stay within the caps.

    ``unit_bytes[i]`` is the size of one unit of ``costs[i]`` (for the message of a refusal).
    """
    n = costs[0].shape[0]
    cums = [_excl_cumsum(c) for c in costs]
    out = []
    a = 0
    while a < n:
        b = n
        for cum, cap in zip(cums, caps):
            b = min(b, int(np.searchsorted(cum, cum[a] + cap, side="right")) - 1)
        if b <= a:
            over = [f"{int(c[a])} {nm} = {int(c[a]) * ub} bytes (at most {cap * ub} bytes fit)"
                    for c, cap, nm, ub in zip(costs, caps, names, unit_bytes) if c[a] > cap]
            raise UnsupportedError(
                f"backend 'wgpu': {what} {a} alone needs {', '.join(over)} in one storage binding of "
                f"{binding} bytes; nothing was allocated. Lower topk, or use a device (or "
                "max_binding_size) with larger bindings [R18]")
        out.append((a, b))
        a = b
    return out


def _caps(geom: Geometry, binding: int) -> tuple[int, int, int]:
    """(max partial rows, max u32 words, max q/out rows of G*D floats) per binding."""
    prows = min(binding // (4 * geom.D), binding // 8)
    words = binding // 4
    qrows = binding // (4 * geom.G * geom.D)
    return prows, words, qrows


def _fits_one_batch(view: IndexView, geom: Geometry, n_chunks: int, n_rows: int, cap_prows: int,
                    cap_words: int, cap_qrows: int) -> bool:
    """Whether all rows surely fit one forward batch.

    Upper bounds of the totals of the per-row costs :func:`plan_forward` hands to
    :func:`_batches`, in closed form: an edge is at most ``k = min(n_chunks, ppb)`` pieces (one
    per chunk its block's pages lie in) and costs ``G k`` partial rows and ``2 + head_splits k
    (ITEM_WORDS + ppb)`` plan words, and a row ``G + 1`` merge words besides its partial rows.
    Exact with one chunk; with more, a call that fits only the exact costs takes the per-row path.
    """
    E, G = view.E, geom.G
    k = min(n_chunks, view.ppb)
    return (G * E * k <= cap_prows and E * (2 + geom.head_splits * k * (ITEM_WORDS + view.ppb)) <= cap_words
            and G * E * k + n_rows * (G + 1) <= cap_words and n_rows <= cap_qrows)


def _edge_costs(view: IndexView, geom: Geometry, smap: SlabMap, eids_order: np.ndarray):
    """Upper bounds per edge: partial rows, plan words (items + records + pages), merge words."""
    nch = view.chunks_per_slot(smap)[view.slot_of_edge[eids_order]]
    prows = geom.G * nch
    plan = 2 + geom.head_splits * nch * (ITEM_WORDS + view.ppb)
    return prows, plan


def plan_forward(view: IndexView, geom: Geometry, smap: SlabMap, binding: int) -> list[BatchPlan]:
    """Batches of (query, KV head) rows; each batch combines its rows completely."""
    idx = view.index
    n_rows = idx.num_queries * view.Hkv
    if n_rows == 0 or view.E == 0:
        return []
    row_ptr = idx.row_ptr.astype(np.int64)
    cap_prows, cap_words, cap_qrows = _caps(geom, binding)
    if _fits_one_batch(view, geom, smap.n_chunks, n_rows, cap_prows, cap_words, cap_qrows):
        ranges = [(0, n_rows)]  # what _batches gives when everything fits, without the per-row costs
    else:
        rprows, rplan = _edge_costs(view, geom, smap, idx.row_edges.astype(np.int64))
        nonempty = np.diff(row_ptr) > 0
        per_row_prows = np.zeros(n_rows, dtype=np.int64)
        per_row_plan = np.zeros(n_rows, dtype=np.int64)
        if rprows.size:
            starts = row_ptr[:-1][nonempty]
            per_row_prows[nonempty] = np.add.reduceat(rprows, starts)
            per_row_plan[nonempty] = np.add.reduceat(rplan, starts)
        ones = np.ones(n_rows, dtype=np.int64)
        ranges = _batches(
            [per_row_prows, per_row_plan, per_row_prows + geom.G + 1, ones],
            [cap_prows, cap_words, cap_words, cap_qrows],
            ["partial rows", "plan words", "merge words", "query rows"], "(query, KV head) row", binding,
            [4 * geom.D, 4, 4, 4 * geom.G * geom.D])
    plans = []
    for r0, r1 in ranges:
        sl_edges = idx.row_edges[row_ptr[r0]:row_ptr[r1]].astype(np.int64)  # by row, rank order
        if sl_edges.size == 0:
            continue
        # every edge of rows r0:r1; a single batch holds them all (no sort needed)
        full = sl_edges.shape[0] == view.E
        eids = np.arange(view.E, dtype=np.int64) if full else np.sort(sl_edges)
        lrow = view.edge_row if full and r0 == 0 else view.edge_row[eids] - r0
        it = _items(view, geom, smap, eids, lrow, full=full)
        n_rows = r1 - r0
        if it["identity"]:  # group of edge e = its local index: the row lists its edges in rank order
            ptr = row_ptr[r0:r1 + 1] - row_ptr[r0]
            if full:  # local index = edge id
                elems = sl_edges
            else:
                local = np.empty(view.E, dtype=np.int64)
                local[eids] = np.arange(eids.shape[0], dtype=np.int64)
                elems = local[sl_edges]
        else:
            le, ch = it["group_le"], it["group_chunk"]
            # by row, then rank, then chunk: one sort on a combined key (keys are unique)
            rank = view.edge_rank[eids][le]
            order = np.argsort((lrow[le] * (int(rank.max(initial=0)) + 1) + rank) * smap.n_chunks + ch)
            ptr = _excl_cumsum(np.bincount(lrow[le], minlength=n_rows))
            elems = order
        merge = np.concatenate([ptr, elems]).astype(np.uint32)
        plans.append(BatchPlan(it["words"], it["dispatches"], it["n_prows"], False, merge, n_rows * geom.G,
                               slice(r0, r1), slice(r0 * geom.G, r1 * geom.G), geom.G))
    return plans


def plan_partials(view: IndexView, geom: Geometry, smap: SlabMap, binding: int) -> list[BatchPlan]:
    """Batches of consecutive edges; each batch writes the [E_b, G] partials of its edges."""
    E = view.E
    if E == 0:
        return []
    eall = np.arange(E, dtype=np.int64)
    eprows, eplan = _edge_costs(view, geom, smap, eall)
    cap_prows, cap_words, cap_qrows = _caps(geom, binding)
    g1 = np.full(E, geom.G, dtype=np.int64)
    ranges = _batches([eprows, eplan, eprows + g1 + 1, np.ones(E, dtype=np.int64)],
                      [cap_prows, cap_words, cap_words, min(cap_qrows, cap_prows // geom.G)],
                      ["partial rows", "plan words", "merge words", "query rows"], "edge", binding,
                      [4 * geom.D, 4, 4, 4 * geom.G * geom.D])
    plans = []
    for e0, e1 in ranges:
        eids = eall[e0:e1]
        rows = view.edge_row[eids]
        q_rows, lrow = unique_inverse(rows)
        it = _items(view, geom, smap, eids, lrow.reshape(-1).astype(np.int64), full=(e1 - e0 == E))
        merge = None
        if not it["identity"]:  # merge the per-chunk pieces of every edge
            le, ch = it["group_le"], it["group_chunk"]
            order = np.argsort(le * smap.n_chunks + ch)  # by edge, then chunk (unique keys)
            ptr = _excl_cumsum(np.bincount(le, minlength=e1 - e0))
            merge = np.concatenate([ptr, order]).astype(np.uint32)
        plans.append(BatchPlan(it["words"], it["dispatches"], it["n_prows"], it["identity"], merge,
                               (e1 - e0) * geom.G, q_rows, slice(e0 * geom.G, e1 * geom.G), geom.G))
    return plans


def partials_grid(count: int, gx: int, gy: int, geom: Geometry, max_per_dim: int) -> tuple[int, int]:
    """The grid of a partials dispatch of ``count`` items (``gx``, ``gy`` from
    :func:`grid_dispatches`), fewer workgroups for a kernel whose workgroups loop over items."""
    cap = geom.max_workgroups
    if cap is None or count <= cap:
        return gx, gy
    gx = min(cap, max_per_dim)
    return gx, -(-cap // gx)


def grid_dispatches(n_groups: int, max_per_dim: int):
    """Split ``n_groups`` workgroups into dispatches of 2-D grids within ``max_per_dim``.

    Yields ``(first, count, grid_x, grid_y)``; the kernel linearises ``y * grid_x + x`` and
    ignores ids >= count.
    """
    per = max_per_dim * max_per_dim
    first = 0
    while first < n_groups:
        count = min(per, n_groups - first)
        gx = min(count, max_per_dim)
        gy = -(-count // gx)
        yield first, count, gx, gy
        first += count
