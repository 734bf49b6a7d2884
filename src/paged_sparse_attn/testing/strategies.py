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
from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st

from .._types import Capabilities
from .._validation import FLOAT_DTYPES
from .mutations import INDEX_MUTATIONS, INDEX_RULES, MUTATIONS, RULES, Mutation, Pick  # noqa: F401  (re-exported)
from .problem import FORWARD_ARGS, AttentionProblem, InvalidCall, to_layout

__all__ = [
    "cu_seqlens",
    "block_tables",
    "kv_lens",
    "selections",
    "problems",
    "invalid_problems",
    "index_problems",
    "invalid_index_problems",
    "INDEX_RULES",
    "INDEX_MUTATIONS",
    "IndexCase",
    "PageTable",
    "RULES",
    "MUTATIONS",
    "make_values",
    "KV_LAYOUTS",
]

KV_LAYOUTS = ("HND", "NHD")  # R34



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


def _layout_choices(caps: Capabilities | None, kv_layout) -> st.SearchStrategy:
    """The page layouts to draw (R34): those requested that the backend declares."""
    if isinstance(kv_layout, st.SearchStrategy):
        return kv_layout
    wanted = [kv_layout] if isinstance(kv_layout, str) else list(kv_layout)
    have = getattr(caps, "kv_layouts", ("HND",)) if caps is not None else KV_LAYOUTS
    out = [x for x in wanted if x in have]
    if not out:
        raise ValueError(f"problems(): no kv_layout is both requested ({wanted}) and supported ({list(have)})")
    return st.sampled_from(out)


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
    kv_layout=KV_LAYOUTS,
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
    kv_layout : str, sequence or strategy
        Page layouts the calls pass the caches in (R34); default both, restricted to
        ``caps.kv_layouts``. The problem's ``k_cache`` / ``v_cache`` stay logical
        ``[P, Hkv, S, D]``; ``kwargs()`` hands them over in the drawn layout.
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
    layout = draw(_layout_choices(caps, kv_layout))
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
                            softmax_scale=scale, causal=is_causal, values=f"{kind}(seed={seed})", kv_layout=layout)


# --- index-branch problems (R21-R25) ---------------------------------------------------------

class IndexCase(tuple):
    """``(problem, index_q [Tq, Hkv, d_idx], index_k_cache [P, Hk_idx, S, d_idx])``, as drawn by
    :func:`index_problems`: a valid forward problem and index inputs paged like its caches.

    ``index_k_cache`` is logical ``[P, Hk_idx, S, d_idx]``, like the problem's caches;
    :meth:`sparse_kwargs` hands every cache over in the problem's ``kv_layout`` (R34)."""

    __slots__ = ()

    def __new__(cls, problem: AttentionProblem, index_q: np.ndarray, index_k_cache: np.ndarray):
        return super().__new__(cls, (problem, index_q, index_k_cache))

    problem = property(lambda self: self[0])
    index_q = property(lambda self: self[1])
    index_k_cache = property(lambda self: self[2])

    def score_args(self) -> tuple:
        """The positional arguments of ``block_scores`` (and ``block_scores_reference``)."""
        p = self.problem
        return (self.index_q, self.index_k_cache, p.block_tables, p.cu_seqlens_q, p.used_kv_lens)

    def sparse_kwargs(self) -> dict:
        """Every argument of ``sparse_attention`` but ``topk`` by keyword, the caches and the
        index keys in the problem's ``kv_layout`` (R34)."""
        p = self.problem
        kw = {n: v for n, v in p.kwargs().items() if n != "selected"}
        kw.update(index_q=self.index_q, index_k_cache=to_layout(self.index_k_cache, p.kv_layout))
        return kw


@st.composite
def index_problems(draw, *, caps: Capabilities | None = None, index_dim=(4, 1, 3, 8),
                   shared_index_head=st.booleans(), **problem_kwargs) -> IndexCase:
    """A valid problem of the index branch: :func:`problems` plus index queries and keys (R21).

    ``index_k_cache`` has the pages and page size of the caches and ``Hk_idx`` = 1 (one index
    key head shared by every KV head) or ``Hkv``; index data are standard normal, in the cache's
    dtype, from a drawn seed. ``index_dim`` is bounded by ``caps.max_head_dim``.
    """
    p = draw(problems(caps=caps, **problem_kwargs))
    d = draw(_bounded(index_dim, caps.max_head_dim if caps else None))
    hk = 1 if draw(_s(shared_index_head)) else p.num_kv_heads
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    iq = rng.standard_normal((p.num_queries, p.num_kv_heads, d)).astype(p.k_cache.dtype)
    ik = rng.standard_normal((p.num_pages, hk, p.page_size, d)).astype(p.k_cache.dtype)
    return IndexCase(p, iq, ik)


# --- invalid problems: one rule violation at a time (R17) ------------------------------------

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
            kwargs.update({n: to_layout(v, base.kv_layout) if n in ("k_cache", "v_cache") and "kv_layout" not in changes
                           else v for n, v in changes.items()})  # mutations change logical caches
            return InvalidCall({n: kwargs[n] for n in FORWARD_ARGS}, rule, what, base)
    raise AssertionError("unreachable: some mutation applies to every problem")  # pragma: no cover


SPARSE_ATTENTION_ARGS = ("q", "k_cache", "v_cache", "index_q", "index_k_cache", "block_tables", "cu_seqlens_q",
                         "used_kv_lens", "block_size", "topk", "causal", "softmax_scale", "kv_layout")


@st.composite
def invalid_index_problems(draw, *, caps: Capabilities | None = None, rules: Sequence[str] = INDEX_RULES,
                           **problem_kwargs) -> InvalidCall:
    """A call of ``sparse_attention`` that violates exactly one index-branch rule (R17).

    A small valid :func:`index_problems` case is drawn, then one mutation of
    :data:`INDEX_MUTATIONS` for one of ``rules``; ``InvalidCall.kwargs`` are the keyword
    arguments of :func:`paged_sparse_attn.index_branch.sparse_attention`.
    """
    rules = list(rules)
    unknown = [r for r in rules if r not in INDEX_MUTATIONS]
    if unknown:
        raise ValueError(f"invalid_index_problems(): unknown rule ids {unknown}; known: {list(INDEX_MUTATIONS)}")
    problem_kwargs.setdefault("max_queries", 6)
    case = draw(index_problems(caps=caps, **problem_kwargs))
    pick: Pick = lambda lo, hi: draw(st.integers(lo, hi))  # noqa: E731
    candidates = [(r, m) for r in rules for m in INDEX_MUTATIONS[r]]
    order = draw(st.permutations(range(len(candidates))))
    for i in order:
        rule, mutate = candidates[i]
        got = mutate(case, pick)
        if got is not None:
            changes, what = got
            p = case.problem
            changes = {n: to_layout(v, p.kv_layout) if n in ("k_cache", "v_cache", "index_k_cache") else v
                       for n, v in changes.items()}  # mutations change logical caches
            kwargs = {**case.sparse_kwargs(), "topk": max(1, p.topk), **changes}
            return InvalidCall({n: kwargs[n] for n in SPARSE_ATTENTION_ARGS}, rule, what, p)
    raise AssertionError("unreachable: some mutation applies to every case")  # pragma: no cover
