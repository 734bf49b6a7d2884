"""A small seeded problem generator and dtype-derived tolerances for the plain tests.

``make_problem`` builds paged caches the way a serving engine leaves them: physical pages in a
scrambled order, unmapped (-1) holes in the block tables, spare pages that no sequence maps,
pages past ``msb * ppb`` in a row, optionally pages shared between sequences. With
``poison=True`` every cache cell that no query attends (R9) holds NaN, +Inf or -Inf, so any
read of unattended memory (R10) shows up in the output.

The attended sets are computed here, independently of the package, with numpy masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

__all__ = [
    "Problem",
    "make_problem",
    "attended_mask",
    "tolerance",
    "assert_close_to_reference",
    "assert_same_empty_rows",
]


@dataclass
class Problem:
    """One forward problem: the arguments of ``psa.forward`` (R1-R8)."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    block_tables: np.ndarray
    selected: np.ndarray
    cu_seqlens_q: np.ndarray
    used_kv_lens: np.ndarray | None
    block_size: int
    softmax_scale: float | None = None
    causal: bool = False
    notes: dict = field(default_factory=dict)

    @property
    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.selected, self.cu_seqlens_q)

    @property
    def kwargs(self) -> dict:
        return dict(used_kv_lens=self.used_kv_lens, block_size=self.block_size,
                    softmax_scale=self.softmax_scale, causal=self.causal)

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.k_cache.shape[1]

    def index_kwargs(self) -> dict:
        """Arguments of ``psa.build_kvouter_index`` after the three positional arrays."""
        return dict(block_size=self.block_size, page_size=self.page_size, causal=self.causal)

    def with_(self, **changes) -> "Problem":
        return replace(self, **changes)


def _lens_or_default(bt: np.ndarray, used: np.ndarray | None, block_size: int, page_size: int) -> np.ndarray:
    msb = bt.shape[1] // (block_size // page_size)
    if used is None:
        return np.full(bt.shape[0], msb * block_size, dtype=np.int64)  # R4 default
    return np.asarray(used, dtype=np.int64)


def attended_mask(pb: Problem) -> np.ndarray:
    """Boolean [Tq, Hkv, msb*BS]: position p is in A(t, h) (R9), computed with numpy masks."""
    sel = np.asarray(pb.selected, dtype=np.int64)
    bt = np.asarray(pb.block_tables, dtype=np.int64)
    cu = np.asarray(pb.cu_seqlens_q, dtype=np.int64)
    Tq, Hkv, _ = sel.shape
    BS, S = pb.block_size, pb.page_size
    msb = bt.shape[1] // (BS // S)
    lens = _lens_or_default(bt, pb.used_kv_lens, BS, S)
    pos = np.arange(msb * BS)
    mask = np.zeros((Tq, Hkv, msb * BS), dtype=bool)
    for b in range(bt.shape[0]):
        T = cu[b + 1] - cu[b]
        L = lens[b]
        mapped = bt[b, pos // S] >= 0
        for i, t in enumerate(range(cu[b], cu[b + 1])):
            hi = L if not pb.causal else min(L, L - T + i + 1)
            for h in range(Hkv):
                chosen = np.zeros(msb, dtype=bool)
                ids = sel[t, h][sel[t, h] >= 0]
                chosen[ids] = True
                mask[t, h] = chosen[pos // BS] & mapped & (pos < hi)
    return mask


def make_problem(
    seed: int,
    *,
    seqlens_q=(2, 1, 0),
    Hkv: int = 2,
    G: int = 2,
    D: int = 8,
    page_size: int = 2,
    ppb: int = 2,
    msb: int = 3,
    topk: int | None = None,
    used: str | list = "random",
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
) -> Problem:
    """A random valid problem with scrambled pages, holes, spare pages and NaN/Inf poison.

    Parameters
    ----------
    seed : int
        Everything is drawn from ``np.random.default_rng(seed)``.
    seqlens_q : sequence of int
        T_b of each sequence (0 = an empty sequence).
    Hkv, G, D, page_size, ppb, msb : int
        KV heads, GQA group, head dim, page size S, pages per block, max sparse blocks.
    topk : int, optional
        Slots per (t, h) row; default ``msb + 1`` (so rows are padded with -1).
    used : "random", "full", "zero", "default" or list of int
        L_b of each sequence; "random" mixes 0, non-multiples of the block size and the full
        length; "default" passes ``used_kv_lens=None`` (R4).
    causal : bool
    dtype, q_dtype : numpy dtype
        Cache dtype and query dtype (default: the cache dtype).
    hole_prob : float
        Probability that a logical page is unmapped (-1).
    share_prob : float
        Probability that a logical page maps to a page another sequence already uses.
    spare_pages : int
        Physical pages no sequence maps.
    tail_pages : int
        Extra columns of ``block_tables`` past ``msb * ppb`` (mapped to poisoned pages; R5).
    fill : float
        Probability that a slot of a row holds a block id (else -1).
    poison : bool
        Fill every cache cell that no query attends with NaN / +Inf / -Inf (R10).
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

    # used KV lengths
    if used == "random":
        lens = np.array([rng.choice([0, cap, int(rng.integers(0, cap + 1)), int(rng.integers(1, cap + 1))])
                         for _ in range(B)], dtype=np.int64)
    elif used in ("full", "default"):
        lens = np.full(B, cap, dtype=np.int64)
    elif used == "zero":
        lens = np.zeros(B, dtype=np.int64)
    else:
        lens = np.asarray(used, dtype=np.int64)

    # block tables: scrambled physical ids, holes, shared pages, tail pages past msb*ppb
    max_pages = msb * ppb + tail_pages
    logical = np.full((B, max_pages), -1, dtype=np.int64)
    n_owned = 0
    for b in range(B):
        for j in range(max_pages):
            if rng.random() < hole_prob:
                continue
            if n_owned and rng.random() < share_prob:
                logical[b, j] = int(rng.integers(0, n_owned))
            else:
                logical[b, j] = n_owned
                n_owned += 1
    P = n_owned + spare_pages
    perm = rng.permutation(P)  # physical page of each allocated page: scrambled
    bt = np.where(logical >= 0, perm[np.maximum(logical, 0)], -1)

    # selection: unique ids per row, -1 padding, shuffled slot order
    sel = np.full((Tq, Hkv, topk), -1, dtype=np.int64)
    for t in range(Tq):
        for h in range(Hkv):
            n = int(rng.binomial(min(topk, msb), fill)) if topk else 0
            row = np.concatenate([rng.permutation(msb)[:n], np.full(topk - n, -1)])
            sel[t, h] = rng.permutation(row)

    k = rng.standard_normal((P, Hkv, S, D)).astype(dtype)
    v = rng.standard_normal((P, Hkv, S, D)).astype(dtype)
    q = rng.standard_normal((Tq, Hkv * G, D)).astype(q_dtype)

    if pass_lens is None:
        pass_lens = used != "default"
    pb = Problem(q, k, v, bt, sel, cu, lens if pass_lens else None, BS,
                 softmax_scale=softmax_scale, causal=causal)
    if poison:
        poison_unattended(pb, rng)
    return pb


def poison_unattended(pb: Problem, rng: np.random.Generator) -> int:
    """Write NaN/+Inf/-Inf into every (page, head, slot) cell that no query attends; returns the count."""
    mask = attended_mask(pb)  # [Tq, Hkv, msb*BS]
    bt = np.asarray(pb.block_tables, dtype=np.int64)
    cu = np.asarray(pb.cu_seqlens_q, dtype=np.int64)
    S = pb.page_size
    P, Hkv = pb.k_cache.shape[:2]
    read = np.zeros((P, Hkv, S), dtype=bool)
    for b in range(bt.shape[0]):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        seen = mask[lo:hi].any(axis=0)  # [Hkv, msb*BS]
        for p in np.flatnonzero(seen.any(axis=0)):
            page = bt[b, p // S]
            read[page, :, p % S] |= seen[:, p]
    bad = ~read
    vals = np.array([np.nan, np.inf, -np.inf], dtype=pb.k_cache.dtype)
    for arr in (pb.k_cache, pb.v_cache):
        arr[bad] = vals[rng.integers(0, 3, size=(int(bad.sum()), arr.shape[-1]))]
    pb.notes["poisoned_cells"] = int(bad.sum())
    return int(bad.sum())


# --- tolerances (R20) ------------------------------------------------------------------------

def _eps(dtype) -> float:
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return 2.0 ** -7
    return float(np.finfo(dt).eps)


# Multiples of the unit roundoff a correct implementation stays within, per storage dtype.
# float32: scores are D-term dot products and the combine sums O(#edges) rescaled terms, each
# step adding ~eps relative error: 64 eps (~7.6e-6) covers D <= 64 and a few dozen positions.
# float16 / bfloat16 (R20): one rounding of K perturbs a score by ~|score| eps / 2 and of V the
# output by eps / 2; 8 eps covers scores of magnitude up to a few units.
_FACTOR = {"float32": 64.0, "float16": 8.0, "bfloat16": 8.0}


def tolerance(dtype) -> float:
    """Relative tolerance (to the output scale) for results computed from ``dtype`` data (R20)."""
    dt = np.dtype(dtype)
    return _FACTOR.get(dt.name, 64.0) * _eps(dt)


def assert_same_empty_rows(lse: np.ndarray, ref_lse: np.ndarray) -> None:
    """Rows with an empty attended set have lse = -inf in both, and only those (R11)."""
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse),
                                  err_msg="rows with lse = -inf differ (R11)")


def assert_close_to_reference(out, ref, dtype, *, lse=None, ref_lse=None, what: str = "") -> None:
    """Assert ``out`` (and ``lse``) agree with the float64 reference to a dtype-derived tolerance.

    ``out`` is a convex combination of V rows, so its error is measured relative to the output
    scale ``max(1, max |ref|)``; ``lse`` relative to ``max(1, |ref_lse|)`` per entry. Both must be
    free of NaN; ``-inf`` entries of ``lse`` must match exactly (R11, R20).
    """
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, f"{what} shape {out.shape} != reference {ref.shape}"
    assert not np.isnan(out).any(), f"{what} output holds NaN"
    assert np.isfinite(out).all(), f"{what} output holds Inf"
    tol = tolerance(dtype)
    scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
    err = float(np.abs(out.astype(np.float64) - ref).max()) if ref.size else 0.0
    assert err <= tol * scale, f"{what} max |out - ref| = {err:.3g} > {tol:.3g} * {scale:.3g} (dtype {np.dtype(dtype).name})"
    if lse is not None:
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        assert lse.shape == ref_lse.shape, f"{what} lse shape {lse.shape} != {ref_lse.shape}"
        assert not np.isnan(lse).any(), f"{what} lse holds NaN"
        assert_same_empty_rows(lse, ref_lse)
        fin = np.isfinite(ref_lse)
        assert np.isfinite(lse[fin]).all(), f"{what} lse is infinite where the reference is finite"
        if fin.any():
            d = np.abs(lse[fin].astype(np.float64) - ref_lse[fin])
            lim = tol * np.maximum(1.0, np.abs(ref_lse[fin]))
            assert (d <= lim).all(), f"{what} max lse error {float(d.max()):.3g} exceeds tolerance"
