"""Hypothesis strategies for paged block-sparse attention problems (needs the ``test`` extra).

Every strategy is keyword-only and draws *structure first, then values*: sizes, then the index
arrays (cu_seqlens_q, block tables, KV lengths, selection), and only then one integer seed from
which the float data are generated with numpy. Failures therefore shrink to small shapes and
simple index arrays, and the seed in the report rebuilds the data.

Size knobs accept an ``int`` (fixed), a list/tuple (one of those values) or a strategy.

Examples
--------
>>> from hypothesis import given
>>> import paged_sparse_attn as psa
>>> from paged_sparse_attn.testing import strategies as pst
>>> @given(pst.problems(caps=psa.get_backend("numpy").capabilities))
... def test_matches_reference(problem):
...     out, lse = problem.forward("numpy")
...     ...
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
from hypothesis import strategies as st

from .._types import Capabilities
from .._validation import FLOAT_DTYPES
from .problem import FORWARD_ARGS, AttentionProblem, InvalidCall

__all__ = [
    "cu_seqlens",
    "block_tables",
    "kv_lens",
    "selections",
    "problems",
    "invalid_problems",
    "PageTable",
    "RULES",
    "MUTATIONS",
    "make_values",
]

RULES = ("R1", "R2", "R3", "R4", "R5", "R6", "R7", "R8")


def _s(x: Any) -> st.SearchStrategy:
    """An int -> just, a list/tuple -> sampled_from, a strategy -> itself."""
    if isinstance(x, st.SearchStrategy):
        return x
    if isinstance(x, (list, tuple)):
        return st.sampled_from(list(x))
    return st.just(x)


# --- cu_seqlens_q ----------------------------------------------------------------------------

@st.composite
def cu_seqlens(draw, *, num_seqs=st.integers(1, 3), queries_per_seq=st.integers(0, 4),
               max_queries: int | None = 12) -> np.ndarray:
    """``cu_seqlens_q`` [B + 1], int32 (R3): 0, non-decreasing; empty sequences included.

    Parameters
    ----------
    num_seqs : int, sequence or strategy
        B (>= 1).
    queries_per_seq : int, sequence or strategy
        T_b of each sequence (0 allowed: an empty sequence).
    max_queries : int, optional
        Cap on Tq = cu[B]; later sequences are shortened to fit.
    """
    B = draw(_s(num_seqs))
    counts = []
    left = max_queries if max_queries is not None else 1 << 30
    for _ in range(B):
        T = min(draw(_s(queries_per_seq)), left)
        counts.append(T)
        left -= T
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32)


# --- block tables ----------------------------------------------------------------------------

class PageTable(tuple):
    """``(block_tables [B, max_pages] int32, num_pages)``, as drawn by ``block_tables``."""

    __slots__ = ()

    def __new__(cls, table: np.ndarray, num_pages: int):
        return super().__new__(cls, (table, num_pages))

    @property
    def table(self) -> np.ndarray:
        return self[0]

    @property
    def num_pages(self) -> int:
        return self[1]


@st.composite
def block_tables(draw, *, num_seqs: int, max_pages: int, holes: bool = True, shared: bool = True,
                 spare_pages=st.integers(0, 3)) -> PageTable:
    """A block table as a serving engine leaves it (R2), with the number of physical pages.

    Physical page ids are scrambled (a drawn permutation), some logical pages are unmapped
    (``-1`` holes), some physical pages are mapped by no sequence (spare pages) and, with
    ``shared``, several logical pages may map the same physical page (prefix sharing).

    Parameters
    ----------
    num_seqs, max_pages : int
        Shape [B, max_pages] of the table.
    holes : bool
        Allow -1 entries.
    shared : bool
        Allow a physical page to be mapped more than once.
    spare_pages : int, sequence or strategy
        Physical pages that no entry maps.

    Returns
    -------
    PageTable
        ``(table, num_pages)`` with every entry -1 or in ``[0, num_pages)``, ``num_pages >= 1``.
    """
    n = num_seqs * max_pages
    hole = [False] * n
    density = draw(st.sampled_from(["none", "few", "many"])) if holes and n else "none"
    if density == "few":  # about one page in four unmapped
        hole = [draw(st.integers(0, 3)) == 3 for _ in range(n)]
    elif density == "many":
        hole = [draw(st.booleans()) for _ in range(n)]
    mapped = [j for j in range(n) if not hole[j]]
    # logical allocation id of every mapped entry: distinct, or (shared) some reuse earlier ones
    alloc = list(range(len(mapped)))
    if shared and len(mapped) > 1 and draw(st.booleans()):
        alloc = []
        for j in range(len(mapped)):
            reuse = bool(alloc) and draw(st.booleans())
            alloc.append(draw(st.integers(0, max(alloc))) if reuse else (max(alloc) + 1 if alloc else 0))
    n_alloc = (max(alloc) + 1) if alloc else 0
    P = max(1, n_alloc + draw(_s(spare_pages)))
    perm = draw(st.permutations(range(P)))  # scrambled physical ids; shrinks to the identity
    flat = np.full(n, -1, dtype=np.int32)
    for j, a in zip(mapped, alloc):
        flat[j] = perm[a]
    return PageTable(flat.reshape(num_seqs, max_pages), P)


# --- used KV lengths -------------------------------------------------------------------------

@st.composite
def kv_lens(draw, *, num_seqs: int, capacity: int, page_size: int = 1, block_size: int = 1) -> np.ndarray:
    """``used_kv_lens`` [B], int32 in ``[0, capacity]`` (R4).

    Biased to the edges: 0, ``capacity`` (full), multiples of the page and block size and their
    neighbours (non-multiples), besides uniform values.
    """
    special = sorted({x + d for m in (page_size, block_size)
                      for x in range(0, capacity + 1, max(1, m)) for d in (-1, 0, 1)})
    special = [x for x in special if 0 < x < capacity] or [capacity]
    lens = []
    for _ in range(num_seqs):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            lens.append(capacity)  # full
        elif kind == 1:
            lens.append(0)  # an empty cache
        elif kind <= 5:
            lens.append(draw(st.sampled_from(special)))  # on or next to a page / block boundary
        else:
            lens.append(draw(st.integers(1, capacity)) if capacity else 0)
    return np.array(lens, dtype=np.int32)


# --- selections ------------------------------------------------------------------------------

@st.composite
def selections(draw, *, num_queries: int, num_kv_heads: int, topk: int, num_blocks: int,
               empty_rows: bool = True, all_blocks: bool = False) -> np.ndarray:
    """``selected`` [Tq, Hkv, topk], int32 (R6): unique ids per row, -1 padding in any slot.

    Parameters
    ----------
    num_queries, num_kv_heads, topk : int
        The shape.
    num_blocks : int
        msb: ids are drawn from ``[0, num_blocks)``.
    empty_rows : bool
        Allow rows with no id at all.
    all_blocks : bool
        Every row selects every block (needs ``topk >= num_blocks``), in a drawn slot order.
    """
    if all_blocks and topk < num_blocks:
        raise ValueError(f"selections(all_blocks=True) needs topk >= num_blocks, got {topk} < {num_blocks}")
    sel = np.full((num_queries, num_kv_heads, topk), -1, dtype=np.int32)
    most = min(topk, num_blocks)
    if most == 0:
        return sel
    mode = "all" if all_blocks else draw(st.sampled_from(["each", "full", "same"]))
    shared_row = None
    for t in range(num_queries):
        for h in range(num_kv_heads):
            if empty_rows and not all_blocks and draw(st.integers(0, 4)) == 4:
                continue  # about one row in five selects nothing
            if mode == "same" and shared_row is not None:
                ids = shared_row  # every row picks the same blocks: big slot groups (R13)
            else:
                n = num_blocks if mode == "all" else (most if mode == "full" else draw(st.integers(1, most)))
                ids = list(draw(st.permutations(range(num_blocks)))[:n])
                shared_row = ids
            slots = draw(st.permutations(range(topk)))[:len(ids)]
            sel[t, h, list(slots)] = ids
    return sel


# --- values ----------------------------------------------------------------------------------

VALUE_KINDS = ("normal", "integers")


def make_values(seed: int, kind: str, *, q_shape, cache_shape, q_dtype, cache_dtype):
    """Float data of a problem from a seed: ``q``, ``k_cache``, ``v_cache``.

    ``"normal"``: standard normal (well conditioned, R20); ``"integers"``: integers in [-3, 3]
    (exact in every dtype, so products are exact in float32).
    """
    rng = np.random.default_rng(seed)
    if kind == "normal":
        q, k, v = (rng.standard_normal(s) for s in (q_shape, cache_shape, cache_shape))
    elif kind == "integers":
        q, k, v = (rng.integers(-3, 4, size=s).astype(np.float64) for s in (q_shape, cache_shape, cache_shape))
    else:
        raise ValueError(f"unknown value kind {kind!r}; expected one of {VALUE_KINDS}")
    return q.astype(q_dtype), k.astype(cache_dtype), v.astype(cache_dtype)


def _dtype_choices(caps: Capabilities | None, dtypes) -> list[np.dtype]:
    known = {d.name: d for d in FLOAT_DTYPES}
    names = [n if isinstance(n, str) else np.dtype(n).name for n in (dtypes if dtypes is not None else known)]
    if caps is not None:
        names = [n for n in names if n in caps.dtypes]
    out = [known[n] for n in names if n in known]
    if not out:
        raise ValueError(f"problems(): no float dtype is both requested ({names}) and supported "
                         f"({None if caps is None else caps.dtypes})")
    return out


def _limit(values: Sequence[int], cap: int | None) -> list[int]:
    kept = [v for v in values if cap is None or v <= cap]
    return kept or ([cap] if cap is not None and cap >= 1 else [1])


def _bounded(x: Any, cap: int | None) -> st.SearchStrategy:
    """A size knob restricted to values <= cap (a backend limit)."""
    if isinstance(x, (list, tuple)):
        return st.sampled_from(_limit(x, cap))
    return _s(x) if cap is None else _s(x).filter(lambda v: v <= cap)


# --- complete problems -----------------------------------------------------------------------

@st.composite
def problems(
    draw,
    *,
    caps: Capabilities | None = None,
    dtypes: Sequence[str] | None = None,
    num_seqs=st.integers(1, 3),
    queries_per_seq=None,
    max_queries: int = 12,
    num_kv_heads=st.integers(1, 2),
    group_size=(1, 2, 3, 4, 5, 8),
    head_dim=(4, 1, 2, 3, 5, 8, 16),
    page_size=(2, 1, 3, 4),
    pages_per_block=(2, 1, 3),
    max_blocks: int = 4,
    max_pages_per_seq: int = 8,
    topk=None,
    causal=st.booleans(),
    holes: bool = True,
    shared_pages: bool = True,
    tail_pages: bool = True,
    empty_rows: bool = True,
    all_blocks: bool = False,
    default_lens=st.booleans(),
    full_lens: bool = False,
    softmax_scale=st.one_of(st.none(), st.sampled_from([1.0, 0.5, 0.3, -0.7])),
    values=VALUE_KINDS,
) -> AttentionProblem:
    """A complete valid problem within a backend's declared capabilities.

    Parameters
    ----------
    caps : Capabilities, optional
        Restrict dtypes, head_dim, page_size and block_size to what the backend declares
        (``dtypes``, ``max_head_dim``, ``max_page_size``, ``max_block_size``).
    dtypes : sequence of str, optional
        Candidate dtypes of q and of the caches (drawn independently; default all R7 dtypes).
    num_seqs, queries_per_seq, num_kv_heads, group_size, head_dim, page_size, pages_per_block
        Size knobs (int, sequence or strategy). ``group_size`` is G = Hq / Hkv. The default
        choices start (and shrink) at a small but non-trivial problem: D = 4, S = 2, two pages
        per block, 1-4 queries per sequence.
    max_queries : int
        Cap on Tq.
    max_blocks, max_pages_per_seq : int
        Caps on msb and on ``msb * pages_per_block``.
    topk : int, sequence, strategy or None
        Slots per row; default drawn in ``[1, msb + 1]``, sometimes 0.
    causal : bool or strategy
    holes, shared_pages : bool
        Allow -1 pages / physical pages mapped more than once.
    tail_pages : bool
        Allow extra block-table columns past ``msb * pages_per_block`` (never read, R5).
    empty_rows : bool
        Allow selection rows with no block id.
    all_blocks : bool
        Every row selects every block (``topk`` >= msb; padding slots may remain).
    default_lens : bool or strategy
        Sometimes pass ``used_kv_lens=None`` (the R4 default).
    full_lens : bool
        Every sequence uses its full capacity ``msb * block_size``.
    softmax_scale : strategy
        None means the R8 default.
    values : str, sequence or strategy
        Value kind, see ``make_values``.
    """
    # structure first ...
    dts = _dtype_choices(caps, dtypes)
    max_head = caps.max_head_dim if caps else None
    max_page = caps.max_page_size if caps else None
    max_block = caps.max_block_size if caps else None
    if max_block is not None:
        max_page = max_block if max_page is None else min(max_page, max_block)
    if queries_per_seq is None:  # 1-4 queries; an empty sequence in about one case in ten
        queries_per_seq = st.integers(0, 9).flatmap(lambda x: st.just(0) if x == 9 else st.integers(1, 4))
    cu = draw(cu_seqlens(num_seqs=num_seqs, queries_per_seq=queries_per_seq, max_queries=max_queries))
    B, Tq = cu.shape[0] - 1, int(cu[-1])
    Hkv = draw(_s(num_kv_heads))
    G = draw(_s(group_size))
    D = draw(_bounded(head_dim, max_head))
    S = draw(_bounded(page_size, max_page))
    ppb_cap = max(1, max_pages_per_seq)
    if max_block is not None:
        ppb_cap = min(ppb_cap, max(1, max_block // S))
    ppb = min(draw(_s(pages_per_block)), ppb_cap)
    BS = S * ppb
    top = max(1, min(max_blocks, max_pages_per_seq // ppb))
    msb = min(top, 2) if draw(st.integers(0, 3)) == 0 else draw(st.integers(1, top))  # often 2 blocks
    tail = draw(st.integers(0, ppb - 1)) if tail_pages and ppb > 1 else 0
    max_pages = msb * ppb + tail
    if topk is None:
        if all_blocks:
            k = draw(st.integers(msb, msb + 1))
        else:  # topk = 0 (nothing selectable) in about one problem in ten
            k = 0 if draw(st.integers(0, 9)) == 9 else draw(st.integers(1, msb + 1))
    else:
        k = max(draw(_s(topk)), msb if all_blocks else 0)
    is_causal = draw(_s(causal))
    # the first dtype (float32 when allowed) in about half the problems, q of the cache's dtype
    # in about two thirds: tolerances of 16-bit data are wide, so they must not dominate
    cache_dtype = dts[0] if draw(st.booleans()) else draw(st.sampled_from(dts))
    q_dtype = cache_dtype if draw(st.integers(0, 2)) < 2 else draw(st.sampled_from(dts))
    scale = draw(_s(softmax_scale))
    # ... then the index arrays ...
    pt = draw(block_tables(num_seqs=B, max_pages=max_pages, holes=holes, shared=shared_pages))
    cap = msb * BS
    use_default = draw(_s(default_lens))
    if full_lens or use_default:
        lens = np.full(B, cap, dtype=np.int32)
    else:
        lens = draw(kv_lens(num_seqs=B, capacity=cap, page_size=S, block_size=BS))
    sel = draw(selections(num_queries=Tq, num_kv_heads=Hkv, topk=k, num_blocks=msb,
                          empty_rows=empty_rows, all_blocks=all_blocks))
    # ... and the values last
    kind = draw(_s(values))
    seed = draw(st.integers(0, 2**32 - 1))
    q, kc, vc = make_values(seed, kind, q_shape=(Tq, Hkv * G, D), cache_shape=(pt.num_pages, Hkv, S, D),
                            q_dtype=q_dtype, cache_dtype=cache_dtype)
    return AttentionProblem(q, kc, vc, pt.table, sel, cu, None if use_default else lens, BS,
                            softmax_scale=scale, causal=is_causal, values=f"{kind}(seed={seed})")


# --- invalid problems: one rule violation at a time (R17) ------------------------------------

Pick = Callable[[int, int], int]  # pick(lo, hi): an int in [lo, hi], drawn by hypothesis
Mutation = Callable[[AttentionProblem, Pick], "tuple[dict, str] | None"]


def _arr(p: AttentionProblem, name: str) -> np.ndarray:
    return np.array(getattr(p, name) if name != "used_kv_lens" else p.kv_lens.astype(np.int32))


def _r1_q_2d(p, pick):
    return {"q": np.ascontiguousarray(p.q[:, 0, :])}, "q is 2-D"


def _r1_cache_3d(p, pick):
    return {"k_cache": np.ascontiguousarray(p.k_cache[:, 0]), "v_cache": np.ascontiguousarray(p.v_cache[:, 0])}, \
        "k_cache and v_cache are 3-D"


def _r1_kv_shapes_differ(p, pick):
    extra = np.zeros((1, *p.v_cache.shape[1:]), dtype=p.v_cache.dtype)
    return {"v_cache": np.concatenate([p.v_cache, extra])}, "v_cache has one page more than k_cache"


def _r1_kv_dtypes_differ(p, pick):
    other = np.float16 if np.dtype(p.k_cache.dtype) != np.float16 else np.float32
    return {"v_cache": p.v_cache.astype(other)}, f"v_cache is {np.dtype(other).name}, k_cache is not"


def _r1_head_dim(p, pick):
    q = np.concatenate([p.q, np.zeros((*p.q.shape[:2], 1), dtype=p.q.dtype)], axis=2)
    return {"q": q}, f"q has head_dim {p.head_dim + 1}, the caches {p.head_dim}"


def _r1_group(p, pick):
    if p.num_kv_heads < 2:
        return None
    q = np.concatenate([p.q, np.zeros((p.q.shape[0], 1, p.q.shape[2]), dtype=p.q.dtype)], axis=1)
    return {"q": q}, f"Hq={p.num_q_heads + 1} is not a multiple of Hkv={p.num_kv_heads}"


def _r1_no_kv_heads(p, pick):
    shape = (p.num_pages, 0, p.page_size, p.head_dim)
    return {"k_cache": np.zeros(shape, p.k_cache.dtype), "v_cache": np.zeros(shape, p.v_cache.dtype)}, \
        "the caches have 0 KV heads"


def _r1_page_size_zero(p, pick):
    shape = (p.num_pages, p.num_kv_heads, 0, p.head_dim)
    return {"k_cache": np.zeros(shape, p.k_cache.dtype), "v_cache": np.zeros(shape, p.v_cache.dtype)}, \
        "the caches have page size 0"


def _r2_below(p, pick):
    bt = _arr(p, "block_tables")
    b, j = pick(0, bt.shape[0] - 1), pick(0, bt.shape[1] - 1)
    bt[b, j] = -pick(2, 5)
    return {"block_tables": bt}, f"block_tables[{b}, {j}] = {int(bt[b, j])} < -1"


def _r2_above(p, pick):
    bt = _arr(p, "block_tables")
    b, j = pick(0, bt.shape[0] - 1), pick(0, bt.shape[1] - 1)
    bt[b, j] = p.num_pages + pick(0, 3)
    return {"block_tables": bt}, f"block_tables[{b}, {j}] = {int(bt[b, j])} >= P={p.num_pages}"


def _r2_1d(p, pick):
    return {"block_tables": _arr(p, "block_tables").reshape(-1)}, "block_tables is 1-D"


def _r3_first(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    cu[0] = pick(1, 3)
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q[0] = {int(cu[0])}"


def _r3_last(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    cu[-1] += pick(1, 3)
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q[-1] = {int(cu[-1])} != Tq={p.num_queries}"


def _r3_decreasing(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    if cu.shape[0] < 3:
        return None
    j = pick(1, cu.shape[0] - 2)
    cu[j] = cu[j + 1] + pick(1, 2)
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q decreases at [{j}, {j + 1}]"


def _r3_length(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    cu = np.append(cu, cu[-1]) if pick(0, 1) or cu.shape[0] < 2 else cu[1:]
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q has {cu.shape[0]} entries, B+1={p.num_seqs + 1}"


def _r3_2d(p, pick):
    return {"cu_seqlens_q": _arr(p, "cu_seqlens_q")[None, :]}, "cu_seqlens_q is 2-D"


def _r4_negative(p, pick):
    lens = _arr(p, "used_kv_lens")
    b = pick(0, lens.shape[0] - 1)
    lens[b] = -pick(1, 4)
    return {"used_kv_lens": lens}, f"used_kv_lens[{b}] = {int(lens[b])} < 0"


def _r4_too_long(p, pick):
    lens = _arr(p, "used_kv_lens")
    b = pick(0, lens.shape[0] - 1)
    lens[b] = p.msb * p.block_size + pick(1, 4)
    return {"used_kv_lens": lens}, f"used_kv_lens[{b}] = {int(lens[b])} > msb*block_size"


def _r4_length(p, pick):
    lens = _arr(p, "used_kv_lens")
    return {"used_kv_lens": np.append(lens, 0)}, f"used_kv_lens has B+1={p.num_seqs + 1} entries"


def _r5_not_positive(p, pick):
    bs = -p.page_size * pick(0, 2)
    return {"block_size": bs}, f"block_size = {bs}"


def _r5_not_multiple(p, pick):
    if p.page_size < 2:
        return None
    bs = p.block_size + pick(1, p.page_size - 1)
    return {"block_size": bs}, f"block_size = {bs} is not a multiple of page_size={p.page_size}"


def _r5_not_int(p, pick):
    bad = [float(p.block_size), True, None, str(p.block_size)][pick(0, 3)]
    return {"block_size": bad}, f"block_size = {bad!r}"


def _r5_msb_zero(p, pick):
    # msb = max_pages // ppb = 0; the selection and the lengths are made consistent with msb = 0
    bs = p.page_size * (p.block_tables.shape[1] + pick(1, 2))
    return {"block_size": bs, "selected": np.full_like(p.selected, -1),
            "used_kv_lens": np.zeros(p.num_seqs, dtype=np.int32)}, f"block_size = {bs} leaves msb = 0"


def _sel_with_slot(p):
    """``selected`` with one more (padding) column, so that any row has a free slot."""
    return np.concatenate([p.selected, np.full((*p.selected.shape[:2], 1), -1, np.int32)], axis=2)


def _r6_too_big(p, pick):
    if p.num_queries == 0:
        return None
    sel = _sel_with_slot(p)
    t, h = pick(0, sel.shape[0] - 1), pick(0, sel.shape[1] - 1)
    sel[t, h, -1] = p.msb + pick(0, 3)
    return {"selected": sel}, f"selected[{t}, {h}, -1] = {int(sel[t, h, -1])} >= msb={p.msb}"


def _r6_below(p, pick):
    if p.num_queries == 0:
        return None
    sel = _sel_with_slot(p)
    t, h = pick(0, sel.shape[0] - 1), pick(0, sel.shape[1] - 1)
    sel[t, h, -1] = -pick(2, 5)
    return {"selected": sel}, f"selected[{t}, {h}, -1] = {int(sel[t, h, -1])} < -1"


def _r6_duplicate(p, pick):
    if p.num_queries == 0:
        return None
    sel = np.concatenate([_sel_with_slot(p), np.full((*p.selected.shape[:2], 1), -1, np.int32)], axis=2)
    t, h = pick(0, sel.shape[0] - 1), pick(0, sel.shape[1] - 1)
    s = pick(0, p.msb - 1)
    row = sel[t, h]
    row[row == s] = -1  # place s exactly twice, in the two new slots
    row[-2:] = s
    return {"selected": sel}, f"selected[{t}, {h}] repeats block id {s}"


def _r6_shape(p, pick):
    sel = _arr(p, "selected")
    if pick(0, 1):
        sel = np.concatenate([sel, np.full((1, *sel.shape[1:]), -1, np.int32)], axis=0)
        return {"selected": sel}, f"selected has {sel.shape[0]} rows, Tq={p.num_queries}"
    sel = np.concatenate([sel, np.full((sel.shape[0], 1, sel.shape[2]), -1, np.int32)], axis=1)
    return {"selected": sel}, f"selected has {sel.shape[1]} heads, Hkv={p.num_kv_heads}"


def _r6_2d(p, pick):
    return {"selected": _arr(p, "selected")[:, 0, :]}, "selected is 2-D"


def _r7_float64_q(p, pick):
    return {"q": p.q.astype([np.float64, np.int32, np.complex64][pick(0, 2)])}, "q has a non-float dtype"


def _r7_float64_cache(p, pick):
    dt = [np.float64, np.int16][pick(0, 1)]
    return {"k_cache": p.k_cache.astype(dt), "v_cache": p.v_cache.astype(dt)}, \
        f"k_cache and v_cache are {np.dtype(dt).name}"


def _r7_float_index(p, pick):
    name = ["block_tables", "selected", "cu_seqlens_q", "used_kv_lens"][pick(0, 3)]
    return {name: _arr(p, name).astype(np.float64)}, f"{name} is float64"


def _r7_bool_index(p, pick):
    name = ["block_tables", "selected"][pick(0, 1)]
    return {name: _arr(p, name) >= 0}, f"{name} is bool"


def _r7_list(p, pick):
    # nested lists are read with numpy's inferred dtype: Python floats become float64 (refused)
    name = ["q", "k_cache"][pick(0, 1)]
    if np.asarray(getattr(p, name)).size == 0:
        return None  # an empty nested list loses its shape: that would be R1
    return {name: np.asarray(getattr(p, name), dtype=np.float64).tolist()}, f"{name} is a list of Python floats"


def _r7_int32_overflow(p, pick):
    # Values beyond int32 also break the range rule of the array; R7 is checked first because
    # every later check works on int32 (so the violation is reported as R7).
    name = ["block_tables", "used_kv_lens"][pick(0, 1)]
    a = _arr(p, name).astype(np.int64)
    a.flat[pick(0, a.size - 1)] = 2**31 + pick(0, 10)
    return {name: a}, f"{name} holds a value that does not fit int32"


def _r8_scale(p, pick):
    bad = [float("nan"), float("inf"), -float("inf"), "0.5", True, np.array([0.5])][pick(0, 5)]
    return {"softmax_scale": bad}, f"softmax_scale = {bad!r}"


def _r8_causal(p, pick):
    bad = [1, 0, "yes", None, np.array([True])][pick(0, 4)]
    return {"causal": bad}, f"causal = {bad!r}"


MUTATIONS: dict[str, tuple[Mutation, ...]] = {
    "R1": (_r1_q_2d, _r1_cache_3d, _r1_kv_shapes_differ, _r1_kv_dtypes_differ, _r1_head_dim, _r1_group,
           _r1_no_kv_heads, _r1_page_size_zero),
    "R2": (_r2_below, _r2_above, _r2_1d),
    "R3": (_r3_first, _r3_last, _r3_decreasing, _r3_length, _r3_2d),
    "R4": (_r4_negative, _r4_too_long, _r4_length),
    "R5": (_r5_not_positive, _r5_not_multiple, _r5_not_int, _r5_msb_zero),
    "R6": (_r6_too_big, _r6_below, _r6_duplicate, _r6_shape, _r6_2d),
    "R7": (_r7_float64_q, _r7_float64_cache, _r7_float_index, _r7_bool_index, _r7_list, _r7_int32_overflow),
    "R8": (_r8_scale, _r8_causal),
}
"""The catalogue of single-rule violations: rule id -> mutations of a valid problem."""


@st.composite
def invalid_problems(draw, *, caps: Capabilities | None = None, rules: Sequence[str] = RULES,
                     **problem_kwargs) -> InvalidCall:
    """A call of ``forward`` that violates exactly one rule, tagged with its id (R17).

    A small valid problem is drawn (within ``caps``), then one mutation of ``MUTATIONS``
    for one of ``rules`` is applied.

    Parameters
    ----------
    caps : Capabilities, optional
        The base problem stays within them, so the only fault is the violation.
    rules : sequence of str
        Rule ids to draw from (default R1-R8).
    **problem_kwargs
        Passed to ``problems`` for the base problem.
    """
    rules = list(rules)
    unknown = [r for r in rules if r not in MUTATIONS]
    if unknown:
        raise ValueError(f"invalid_problems(): unknown rule ids {unknown}; known: {list(MUTATIONS)}")
    problem_kwargs.setdefault("max_queries", 6)
    base = draw(problems(caps=caps, **problem_kwargs))
    pick: Pick = lambda lo, hi: draw(st.integers(lo, hi))  # noqa: E731
    candidates = [(r, m) for r in rules for m in MUTATIONS[r]]
    order = draw(st.permutations(range(len(candidates))))
    for i in order:  # the first applicable mutation in a drawn order
        rule, mutate = candidates[i]
        got = mutate(base, pick)
        if got is not None:
            changes, what = got
            kwargs = base.kwargs()
            kwargs.update(changes)
            return InvalidCall({n: kwargs[n] for n in FORWARD_ARGS}, rule, what, base)
    raise AssertionError("unreachable: some mutation applies to every problem")  # pragma: no cover
