"""Seeded generators of paged, block-sparse problems: the one source of problems of the tests, the
demo and the benchmarks.

Every function draws from a ``numpy.random.Generator`` (or a seed of ``default_rng``): the same
seed gives the same problem. The pieces build a problem the way a serving engine leaves one:

* :func:`page_tables` -- ``block_tables`` over a scrambled physical cache: logical pages mapped
  to a random permutation of physical ids, with holes (``-1``), pages shared between sequences,
  spare pages no sequence maps and mapped columns past ``msb * pages_per_block`` (R2, R5);
* :func:`normal_caches` -- K and V pages of standard normal values, of any R7 dtype;
* :func:`random_selection` -- ``selected`` rows of unique random ids, ``-1`` padding anywhere in
  the row and a shuffled slot order (R6);
* :func:`local_topk_selection` -- the MSA selection: the query's own (local) block always,
  then ``topk - 1`` other visible blocks at random, nothing wholly in the future (R9, R24);
* :func:`poison_unattended` -- NaN / +Inf / -Inf in every cache cell no query attends (R10), so
  that a read of unattended memory shows in the output.

Two whole problems are made from them: :func:`random_problem`, small problems that mix every
layout case (the tests), and :func:`msa_problem`, the MSA geometry of the benchmarks (``B``
sequences of one length, the last ``T`` positions of each queried, fully mapped scrambled pages,
the local block forced). The demo composes the pieces into its serving step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .oracle import read_cells
from .problem import AttentionProblem

__all__ = [
    "page_tables",
    "normal_caches",
    "random_selection",
    "local_topk_selection",
    "poison_unattended",
    "random_problem",
    "msa_problem",
]


def page_tables(rng: np.random.Generator, mapped_pages: Sequence[int], max_pages: int, *,
                hole_prob: float = 0.0, share_prob: float = 0.0,
                spare_pages: int = 0) -> tuple[np.ndarray, int, int]:
    """Block tables over a scrambled physical cache (R2).

    Logical page ``j < mapped_pages[b]`` of sequence ``b`` is unmapped (a hole) with probability
    ``hole_prob``, else it maps to a page another sequence already uses with probability
    ``share_prob``, else to a page of its own; columns ``j >= mapped_pages[b]`` are ``-1``. The
    physical id of every page is a random permutation of ``[0, P)``, so pages are scattered over
    the cache; the last ``spare_pages`` of the permutation are mapped by no sequence.

    Parameters
    ----------
    rng : numpy.random.Generator
    mapped_pages : sequence of int, length B
        Logical pages of each sequence that may be mapped (at most ``max_pages``).
    max_pages : int
        Columns of the table.
    hole_prob, share_prob : float
        Probabilities of an unmapped and of a shared logical page.
    spare_pages : int
        Physical pages no sequence maps.

    Returns
    -------
    block_tables : ndarray int32 [B, max_pages]
    num_pages : int
        ``P``, the physical pages of the cache.
    holes : int
        Logical pages left unmapped by ``hole_prob``.
    """
    B = len(mapped_pages)
    logical = np.full((B, max_pages), -1, dtype=np.int64)
    n_owned = holes = 0
    for b in range(B):
        for j in range(int(mapped_pages[b])):
            if rng.random() < hole_prob:
                holes += 1
                continue
            if n_owned and rng.random() < share_prob:
                logical[b, j] = int(rng.integers(0, n_owned))
            else:
                logical[b, j] = n_owned
                n_owned += 1
    P = n_owned + spare_pages
    perm = rng.permutation(P)  # physical page of each allocated page: scrambled
    bt = np.where(logical >= 0, perm[np.maximum(logical, 0)], -1).astype(np.int32)
    return bt, P, holes


def normal_caches(rng: np.random.Generator, shape: tuple[int, int, int, int], dtype,
                  pages: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """K and V caches of standard normal values, ``[P, Hkv, S, D]`` of ``dtype``.

    Values are drawn in float32 and rounded to ``dtype`` (float16, bfloat16). With ``pages``
    only those physical pages are drawn and the others are zero: a large cache whose other
    pages are never read stays cheap to build.
    """
    dt = np.dtype(dtype)
    if pages is None:
        k = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        v = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        return k, v
    k, v = np.zeros(shape, dtype=dt), np.zeros(shape, dtype=dt)
    sub = (len(pages), *shape[1:])
    k[pages] = rng.standard_normal(sub, dtype=np.float32).astype(dt)
    v[pages] = rng.standard_normal(sub, dtype=np.float32).astype(dt)
    return k, v


def random_selection(rng: np.random.Generator, num_queries: int, num_kv_heads: int, msb: int, topk: int,
                     fill: float = 0.7) -> np.ndarray:
    """Random ``selected`` [Tq, Hkv, topk] (int64): unique ids per row, ``-1`` padding (R6).

    Each row holds ``Binomial(min(topk, msb), fill)`` distinct ids of ``[0, msb)``, the slot
    order shuffled, so padding may precede a valid id; blocks past ``L_b`` or in the causal
    future may be chosen (they attend nothing).
    """
    sel = np.full((num_queries, num_kv_heads, topk), -1, dtype=np.int64)
    for t in range(num_queries):
        for h in range(num_kv_heads):
            n = int(rng.binomial(min(topk, msb), fill)) if topk else 0
            row = np.concatenate([rng.permutation(msb)[:n], np.full(topk - n, -1)])
            sel[t, h] = rng.permutation(row)
    return sel


def local_topk_selection(rng: np.random.Generator, cu_seqlens_q, used_kv_lens, *, num_kv_heads: int, msb: int,
                         block_size: int, topk: int, causal: bool = True, shuffle_slots: bool = False) -> np.ndarray:
    """The MSA selection [Tq, Hkv, topk] (int32): the local block and random visible blocks.

    Query ``i`` of sequence ``b`` (``T_b`` queries, right-aligned) last sees position
    ``L_b - T_b + i`` with ``causal`` (``L_b - 1`` without); its local block holds that position
    and is always chosen, with ``min(topk, local + 1) - 1`` other distinct blocks of
    ``[0, local]`` at random; ``-1`` pads the row. A query that sees nothing (``L_b - T_b + i <
    0``) gets a row of ``-1``.

    Parameters
    ----------
    rng : numpy.random.Generator
    cu_seqlens_q : int array [B + 1]
    used_kv_lens : int array [B]
    num_kv_heads, msb, block_size, topk : int
    causal : bool
    shuffle_slots : bool
        False: the local block in slot 0, then the others (as ``select_topk`` with
        ``force_local``, R24). True: slots in random order.
    """
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    lens = np.asarray(used_kv_lens, dtype=np.int64)
    T = np.diff(cu)
    seq = np.repeat(np.arange(T.shape[0]), T)
    Tq = int(cu[-1])
    i = np.arange(Tq) - cu[seq]
    last = lens[seq] - T[seq] + i if causal else lens[seq] - 1
    local = np.where(last >= 0, last // block_size, -1)
    sel = np.full((Tq, num_kv_heads, topk), -1, dtype=np.int32)
    k = min(topk, msb)
    if k == 0 or Tq == 0:
        return sel
    scores = rng.random((Tq, num_kv_heads, msb))
    future = np.broadcast_to(np.arange(msb)[None, None, :] > local[:, None, None], scores.shape)
    scores[future] = -1.0  # blocks past the local one (the future, or past L_b) are never chosen
    rows = np.flatnonzero(local >= 0)
    scores[rows, :, local[rows]] = 2.0  # the local block always is
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    sel[..., :k] = np.where(np.take_along_axis(scores, top, -1) >= 0, top, -1)
    if shuffle_slots:
        order = np.argsort(rng.random(sel.shape), axis=-1)
        sel = np.take_along_axis(sel, order, -1)
    return sel


def poison_unattended(problem: AttentionProblem, rng: np.random.Generator) -> int:
    """Write NaN, +Inf or -Inf into every ``(page, head, slot)`` cell no query attends (R10).

    The caches of ``problem`` are modified in place; the attended cells are those of
    ``oracle.read_cells`` (R9). Returns the number of poisoned cells.
    """
    bad = ~read_cells(problem)
    vals = np.array([np.nan, np.inf, -np.inf], dtype=problem.k_cache.dtype)
    for arr in (problem.k_cache, problem.v_cache):
        arr[bad] = vals[rng.integers(0, 3, size=(int(bad.sum()), arr.shape[-1]))]
    return int(bad.sum())


def random_problem(
    seed: int,
    *,
    seqlens_q: Sequence[int] = (2, 1, 0),
    Hkv: int = 2,
    G: int = 2,
    D: int = 8,
    page_size: int = 2,
    ppb: int = 2,
    msb: int = 3,
    topk: int | None = None,
    used: str | Sequence[int] = "random",
    causal: bool = False,
    dtype=np.float32,
    q_dtype=None,
    hole_prob: float = 0.25,
    share_prob: float = 0.0,
    spare_pages: int = 2,
    tail_pages: int = 1,
    fill: float = 0.7,
    poison: bool = True,
    pass_lens: bool | None = None,
    softmax_scale: float | None = None,
) -> AttentionProblem:
    """A small random valid problem that mixes the layout cases: scrambled pages, holes, spare
    and shared pages, columns past ``msb * ppb``, padded selections and NaN/Inf poison.

    Parameters
    ----------
    seed : int
        Everything is drawn from ``np.random.default_rng(seed)``.
    seqlens_q : sequence of int
        ``T_b`` of each sequence (0 = an empty sequence); ``(1, 1, ...)`` is a decode step.
    Hkv, G, D, page_size, ppb, msb : int
        KV heads, GQA group, head dim, page size ``S``, pages per block, max sparse blocks.
    topk : int, optional
        Slots per (t, h) row; default ``msb + 1`` (so rows are padded with -1).
    used : "random", "full", "zero", "default" or sequence of int
        ``L_b`` of each sequence; "random" mixes 0, non-multiples of the block size and the full
        length; "default" passes ``used_kv_lens=None`` (R4).
    causal : bool
    dtype, q_dtype : numpy dtype
        Cache dtype and query dtype (default: the cache dtype).
    hole_prob, share_prob : float
        Probabilities that a logical page is unmapped (-1), and that it maps to a page another
        sequence already uses.
    spare_pages : int
        Physical pages no sequence maps.
    tail_pages : int
        Extra columns of ``block_tables`` past ``msb * ppb`` (mapped to poisoned pages; R5).
    fill : float
        Probability that a slot of a row holds a block id (else -1).
    poison : bool
        Fill every cache cell that no query attends with NaN / +Inf / -Inf (R10).
    pass_lens : bool, optional
        Pass ``used_kv_lens`` (default: unless ``used="default"``).
    softmax_scale : float, optional

    Returns
    -------
    AttentionProblem
        ``q`` [Tq, G * Hkv, D], caches [P, Hkv, S, D], ``block_tables`` int64
        [B, msb * ppb + tail_pages], ``selected`` int64 [Tq, Hkv, topk], ``cu_seqlens_q`` int64
        [B + 1], ``used_kv_lens`` int64 [B] or None, ``block_size = S * ppb``;
        ``poisoned_cells`` counts the poisoned cells.
    """
    rng = np.random.default_rng(seed)
    S, BS = page_size, page_size * ppb
    B = len(seqlens_q)
    T = np.asarray(seqlens_q, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(T)]).astype(np.int64)
    Tq = int(cu[-1])
    topk = msb + 1 if topk is None else topk
    q_dtype = dtype if q_dtype is None else q_dtype
    cap = msb * BS

    if isinstance(used, str) and used == "random":
        lens = np.array([rng.choice([0, cap, int(rng.integers(0, cap + 1)), int(rng.integers(1, cap + 1))])
                         for _ in range(B)], dtype=np.int64)
    elif isinstance(used, str) and used in ("full", "default"):
        lens = np.full(B, cap, dtype=np.int64)
    elif isinstance(used, str) and used == "zero":
        lens = np.zeros(B, dtype=np.int64)
    else:
        lens = np.asarray(used, dtype=np.int64)

    max_pages = msb * ppb + tail_pages
    bt, P, _ = page_tables(rng, [max_pages] * B, max_pages, hole_prob=hole_prob, share_prob=share_prob,
                           spare_pages=spare_pages)
    bt = bt.astype(np.int64)  # int64 index arrays: the validation narrows them exactly (R7)
    sel = random_selection(rng, Tq, Hkv, msb, topk, fill)

    k = rng.standard_normal((P, Hkv, S, D)).astype(dtype)
    v = rng.standard_normal((P, Hkv, S, D)).astype(dtype)
    q = rng.standard_normal((Tq, Hkv * G, D)).astype(q_dtype)

    if pass_lens is None:
        pass_lens = not (isinstance(used, str) and used == "default")
    values = f"random_problem(seed={seed})"
    pb = AttentionProblem(q, k, v, bt, sel, cu, lens if pass_lens else None, BS, softmax_scale=softmax_scale,
                          causal=causal, values=values)
    if poison:
        pb = pb.replace(poisoned_cells=poison_unattended(pb, rng))
    return pb


def msa_problem(*, B: int, L: int, Tq_per_seq: int, Hq: int = 32, Hkv: int = 4, D: int = 128, page_size: int = 64,
                block_size: int = 128, topk: int = 16, causal: bool = True, dtype="float16", seed: int = 0,
                fill: str = "all") -> AttentionProblem:
    """The MSA geometry of the benchmarks: ``B`` sequences of ``L`` positions, the last
    ``Tq_per_seq`` of each queried, every page mapped and scrambled, the local block forced.

    Parameters
    ----------
    B, L, Tq_per_seq : int
        Sequences, KV length of each, queries per sequence (``1``: decode; more: a prefill chunk,
        right-aligned with ``causal``).
    Hq, Hkv, D, page_size, block_size, topk : int
    causal : bool
    dtype : str
        Cache dtype; ``q`` is float32.
    seed : int
    fill : {"all", "selected"}
        ``"selected"`` draws values only for the pages some query selects and leaves the others
        zero (never read; this keeps very large caches cheap to build).

    Returns
    -------
    AttentionProblem
        ``q`` float32 [B * Tq_per_seq, Hq, D], caches [B * msb * ppb, Hkv, S, D] with
        ``msb = ceil(L / block_size)``, int32 index arrays, ``selected`` from
        :func:`local_topk_selection` (local block in slot 0).
    """
    rng = np.random.default_rng(seed)
    S, BS = page_size, block_size
    ppb = BS // S
    msb = -(-L // BS)
    max_pages = msb * ppb
    bt, P, _ = page_tables(rng, [max_pages] * B, max_pages)
    T = Tq_per_seq
    cu = np.arange(B + 1, dtype=np.int32) * T
    q = rng.standard_normal((B * T, Hq, D), dtype=np.float32)
    lens = np.full(B, L, dtype=np.int32)
    sel = local_topk_selection(rng, cu, lens, num_kv_heads=Hkv, msb=msb, block_size=BS, topk=topk, causal=causal)
    pages = None
    if fill != "all":
        b = np.repeat(np.arange(B), T)
        t_, h_, r_ = np.nonzero(sel >= 0)
        blocks = np.unique(np.stack([b[t_], sel[t_, h_, r_]], 1), axis=0)
        pages = np.unique(bt[blocks[:, :1], blocks[:, 1:] * ppb + np.arange(ppb)])
    k, v = normal_caches(rng, (P, Hkv, S, D), dtype, pages)
    return AttentionProblem(q, k, v, bt, sel, cu, lens, BS, causal=causal,
                            values=f"msa_problem(seed={seed}, fill={fill!r})")
