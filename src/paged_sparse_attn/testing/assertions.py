"""Tolerances of R20 and the comparisons the property suite makes.

A correct backend's error against the float64 reference is float32 arithmetic only: the reference
reads the same (float16, bfloat16 or float32) values, widened exactly. R20 bounds it, to first
order in the unit roundoff ``u = 2**-24``, from the head dimension ``D``, the number ``n`` of
attended positions, the score bound ``sigma = |scale| max_p sum_d |q_d| |k_{p,d}|`` and the value
bound ``V = max |v|`` over the attended positions:

    |out - ref|  <= u (4 (D+1) sigma + 4 n + 18 ln n + 16) V
    |lse - ref|  <= u (3 (D+1) sigma + 2 n + 13 ln n + 8) + 2 u |ref_lse|

:func:`problem_tolerance` computes it for a problem; ``tolerance(..., head_dim=, num_positions=,
score_bound=, value_bound=)`` for given sizes. ``tolerance(*dtypes)`` without sizes keeps the
fixed multiples of eps (64 eps for float32, 8 eps of a 16-bit dtype), measured relative to
``max(1, max |ref|)``: a shortcut calibrated on small problems (D <= 64, a few dozen positions),
not a bound; problems beyond that must use the derived one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterable

import numpy as np

__all__ = [
    "Tolerance",
    "tolerance",
    "problem_tolerance",
    "assert_attention_close",
    "assert_partials_close",
    "assert_empty_rows_exact",
]

# The fixed multiples of eps of ``tolerance(*dtypes)`` without sizes (small problems only).
ULPS = {"float32": 64.0, "float16": 8.0, "bfloat16": 8.0}

U32 = 2.0 ** -24  # unit roundoff of float32: every backend computes in float32 (R12)


def _eps(dtype) -> float:
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":  # ml_dtypes: numpy's finfo does not know it
        return 2.0 ** -7
    return float(np.finfo(dt).eps)


@dataclass(frozen=True)
class Tolerance:
    """Tolerances of R20.

    Without ``value_scale`` (the fixed shortcut): ``|out - ref| <= out * max(1, max |ref|)`` and
    ``|lse - ref| <= lse * max(1, |ref|)``. With ``value_scale`` (the derived bound):
    ``|out - ref| <= out * value_scale`` and ``|lse - ref| <= lse_abs + lse * |ref|``.
    """

    out: float
    lse: float
    value_scale: float | None = None
    lse_abs: float = 0.0

    def out_limit(self, ref_scale: float) -> float:
        """The absolute limit on ``|out - ref|``; ``ref_scale`` is ``max |ref|``."""
        return self.out * (self.value_scale if self.value_scale is not None else max(1.0, ref_scale))

    def lse_limit(self, ref_lse: np.ndarray) -> np.ndarray:
        """The absolute limit on ``|lse - ref_lse|``, entry by entry."""
        if self.value_scale is None:
            return self.lse * np.maximum(1.0, np.abs(ref_lse))
        return self.lse_abs + self.lse * np.abs(ref_lse)

    def times(self, factor: float) -> "Tolerance":
        """This tolerance with every limit multiplied by ``factor`` (e.g. 2 for two rounded results)."""
        return Tolerance(out=self.out * factor, lse=self.lse * factor, value_scale=self.value_scale,
                         lse_abs=self.lse_abs * factor)

    def __str__(self) -> str:
        if self.value_scale is None:
            return f"out {self.out:.3g}, lse {self.lse:.3g}"
        return f"out {self.out:.3g} x V={self.value_scale:.3g}, lse {self.lse_abs:.3g} + {self.lse:.3g} |lse|"


def tolerance(*dtypes, head_dim: int | None = None, num_positions: int | None = None,
              score_bound: float | None = None, value_bound: float | None = None) -> Tolerance:
    """The R20 tolerance.

    Parameters
    ----------
    *dtypes : numpy dtypes (or names)
        E.g. ``tolerance(q.dtype, k_cache.dtype)``; a tuple/list is flattened. Used only by the
        fixed shortcut (no sizes): the least precise dtype wins.
    head_dim, num_positions : int, optional
        ``D`` and the largest number ``n`` of attended positions of a row.
    score_bound : float, optional
        ``sigma = |softmax_scale| max_p sum_d |q_d| |k_{p,d}|`` over attended positions.
    value_bound : float, optional
        ``V = max |v|`` over attended positions.

    Returns
    -------
    Tolerance
        With the four sizes: the derived bound of R20 (the same for every storage dtype: the data
        are exact in float32). Without them: the fixed multiples of eps, never below 64 eps32.

    Examples
    --------
    >>> tolerance("float32").out
    7.62939453125e-06
    >>> tolerance("float32", "float16").out
    0.0078125
    >>> t = tolerance(head_dim=8, num_positions=32, score_bound=2.0, value_bound=1.0)
    >>> round(t.out / 2 ** -24)  # 4 * 9 * 2 + 4 * 32 + 18 ln 32 + 16
    278
    """
    sizes = (head_dim, num_positions, score_bound, value_bound)
    if any(x is not None for x in sizes):
        if any(x is None for x in sizes):
            raise TypeError("tolerance(): head_dim, num_positions, score_bound and value_bound go together")
        D, n = int(head_dim), max(1, int(num_positions))
        sigma, V = float(score_bound), float(value_bound)
        ln = math.log(n)
        out = U32 * (4 * (D + 1) * sigma + 4 * n + 18 * ln + 16)
        lse_abs = U32 * (3 * (D + 1) * sigma + 2 * n + 13 * ln + 8)
        return Tolerance(out=out, lse=2 * U32, value_scale=V, lse_abs=lse_abs)
    flat: list = []
    for d in dtypes:
        flat.extend(d if isinstance(d, (tuple, list)) else [d])
    tol = ULPS["float32"] * _eps(np.float32)
    for d in flat:
        dt = np.dtype(d)
        tol = max(tol, ULPS.get(dt.name, ULPS["float32"]) * _eps(dt))
    return Tolerance(out=tol, lse=tol)


def problem_tolerance(q, k_cache, v_cache, block_tables, selected, cu_seqlens_q, *, used_kv_lens=None,
                      block_size, softmax_scale=None, causal=False, kv_layout="HND") -> Tolerance:
    """The derived R20 tolerance of one forward problem (the arguments of ``forward``).

    ``n``, ``sigma`` and ``V`` are the maxima over all rows, taken over the attended positions
    only (R9), so that NaN or Inf in unattended memory (R10) does not enter them.

    Returns
    -------
    Tolerance
        ``tolerance(head_dim=D, num_positions=n, score_bound=sigma, value_bound=V)``.
    """
    from .._validation import validate_forward
    from ..reference import attended_positions

    p = validate_forward("problem_tolerance", q, k_cache, v_cache, block_tables, selected, cu_seqlens_q,
                         used_kv_lens=used_kv_lens, block_size=block_size, softmax_scale=softmax_scale,
                         causal=causal, kv_layout=kv_layout)
    kc, vc = np.asarray(p.k_cache), np.asarray(p.v_cache)
    if p.kv_layout == "NHD":  # [P, S, Hkv, D] read as [P, Hkv, S, D] (a view, R34)
        kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
    S, G = p.page_size, p.group_size
    n, sigma, V = 1, 0.0, 0.0
    for b in range(p.num_seqs):
        lo, hi = int(p.cu_seqlens_q[b]), int(p.cu_seqlens_q[b + 1])
        for t in range(lo, hi):
            for h in range(p.num_kv_heads):
                pos = attended_positions(p.block_tables[b], p.selected[t, h], int(p.used_kv_lens[b]), hi - lo,
                                         t - lo, block_size=p.block_size, page_size=S, causal=p.causal)
                if not pos:
                    continue
                pages = p.block_tables[b][[x // S for x in pos]]
                k = np.abs(kc[pages, h, [x % S for x in pos]].astype(np.float64))  # [n, D]
                v = np.abs(vc[pages, h, [x % S for x in pos]].astype(np.float64))
                qa = np.abs(p.q[t, h * G:(h + 1) * G].astype(np.float64))  # [G, D]
                n = max(n, len(pos))
                sigma = max(sigma, abs(p.softmax_scale) * float((qa @ k.T).max()))
                V = max(V, float(v.max()))
    return tolerance(head_dim=p.head_dim, num_positions=n, score_bound=sigma, value_bound=V)


def _as_tol(dtype, tol: Tolerance | None) -> Tolerance:
    if tol is not None:
        return tol
    return tolerance(*(dtype if isinstance(dtype, (tuple, list)) else (dtype,)))


def _where(mask: np.ndarray) -> str:
    idx = np.argwhere(mask)
    return str(idx[0].tolist()) if idx.size else "[]"


def assert_empty_rows_exact(out, lse, ref_lse, *, err_msg: str = "") -> None:
    """Rows with an empty attended set (``ref_lse == -inf``) give exactly ``out = 0``, ``lse = -inf`` (R11).

    Parameters
    ----------
    out : array [Tq, Hq, D]
    lse : array [Tq, Hq] or None
    ref_lse : array [Tq, Hq]
        The reference LSE; ``-inf`` marks empty rows.
    """
    out, ref_lse = np.asarray(out), np.asarray(ref_lse)
    empty = np.isneginf(ref_lse)
    if empty.any():
        bad = empty & (out != 0).any(axis=-1)
        assert not bad.any(), (f"{err_msg} row {_where(bad)} attends nothing but out != 0: "
                               f"{out[tuple(np.argwhere(bad)[0])].tolist()} (R11)")
    if lse is not None:
        lse = np.asarray(lse)
        assert np.array_equal(np.isneginf(lse), empty), (
            f"{err_msg} lse = -inf exactly on the rows that attend nothing (R11); first mismatch at "
            f"{_where(np.isneginf(lse) != empty)}: got {lse[tuple(np.argwhere(np.isneginf(lse) != empty)[0])]}")


def assert_attention_close(out, ref, *, dtype, lse=None, ref_lse=None, tol: Tolerance | None = None,
                           rows=None, err_msg: str = "") -> None:
    """Assert attention outputs agree with a reference to the tolerance of ``dtype`` (R20).

    Parameters
    ----------
    out : array [Tq, Hq, D]
        The result under test (float32 from a backend).
    ref : array [Tq, Hq, D]
        The reference (e.g. float64 from [`dense_reference`][paged_sparse_attn.dense_reference]).
    dtype : dtype or tuple of dtypes
        Dtype(s) of the data the result was computed from, e.g. ``problem.dtypes``.
    lse, ref_lse : array [Tq, Hq], optional
        Natural-log LSEs; when given they are compared too, and ``-inf`` entries must match
        exactly (empty rows, R11).
    tol : Tolerance, optional
        Overrides the dtype-derived tolerance (for a documented reason only).
    rows : bool array [Tq, Hq], optional
        Compare only these (t, hq) rows (e.g. rows that read no poisoned cell).
    err_msg : str
        Prefix of the failure message.

    Raises
    ------
    AssertionError
        With the first offending (t, hq, d), both values, the error and the tolerance.
    """
    tol = _as_tol(dtype, tol)
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, f"{err_msg} out shape {out.shape} != reference shape {ref.shape}"
    sel = np.ones(out.shape[:2], dtype=bool) if rows is None else np.asarray(rows, dtype=bool)
    o, r = out[sel].astype(np.float64), ref[sel].astype(np.float64)
    if r.size:
        finite = np.isfinite(r)
        badf = finite & ~np.isfinite(o)
        assert not badf.any(), (f"{err_msg} out is not finite where the reference is: "
                                f"{o[tuple(np.argwhere(badf)[0])]} at row-major entry {_where(badf)}")
        ref_scale = float(np.abs(r[finite]).max()) if finite.any() else 0.0
        limit = tol.out_limit(ref_scale)
        err = np.where(finite, np.abs(o - r), 0.0)
        j = np.unravel_index(int(np.argmax(err)), err.shape)
        worst = float(err[j])
        if worst > limit:
            t_idx = np.argwhere(sel)[j[0]].tolist()
            raise AssertionError(
                f"{err_msg} max |out - ref| = {worst:.4g} at (t, hq)={t_idx}, d={j[1]}: "
                f"got {o[j]:.9g}, want {r[j]:.9g}; limit {limit:.3g} ({tol}) "
                f"(dtype {_dtype_names(dtype)}, R20)")
    if ref_lse is not None:
        ref_lse = np.asarray(ref_lse)
        assert ref_lse.shape == out.shape[:2], f"{err_msg} ref_lse shape {ref_lse.shape} != {out.shape[:2]}"
        b = ref_lse[sel].astype(np.float64)
        a = None
        if lse is not None:
            lse = np.asarray(lse)
            assert lse.shape == ref_lse.shape, f"{err_msg} lse shape {lse.shape} != reference {ref_lse.shape}"
            a = lse[sel].astype(np.float64)
            assert not np.isnan(a).any(), f"{err_msg} lse holds NaN at {_where(np.isnan(a))}"
            fin = np.isfinite(b)
            assert np.isfinite(a[fin]).all(), (
                f"{err_msg} lse is not finite where the reference is, at {_where(fin & ~np.isfinite(a))}")
            if fin.any():
                d = np.abs(a[fin] - b[fin])
                lim = tol.lse_limit(b[fin])
                k = int(np.argmax(d - lim))
                assert d[k] <= lim[k], (f"{err_msg} |lse - ref_lse| = {d[k]:.4g} > {lim[k]:.3g}: got {a[fin][k]:.9g}, "
                                        f"want {b[fin][k]:.9g} (dtype {_dtype_names(dtype)}, R20)")
        assert_empty_rows_exact(out[sel], a, b, err_msg=err_msg)


def _dtype_names(dtype) -> str:
    ds: Iterable = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
    return "/".join(np.dtype(d).name for d in ds)


def assert_partials_close(o, m, l, ref_o, ref_m, ref_l, *, dtype, tol: Tolerance | None = None,
                          err_msg: str = "") -> None:
    """Assert R14 partials agree with reference partials (same edge order).

    ``m`` is compared absolutely to ``max(1, |ref_m|)``; ``l`` (a sum of values in (0, 1])
    relatively; ``o = sum exp(s - m) v`` to ``l * max(1, max |v|-scale)``, where the scale is taken
    from ``ref_o / ref_l``. Empty edges (``ref_m = -inf``) must be exactly ``m = -inf``, ``l = 0``,
    ``o = 0``.

    Parameters
    ----------
    o, m, l : arrays [E, G, D], [E, G], [E, G]
        The partials under test.
    ref_o, ref_m, ref_l : arrays
        Reference partials (float64).
    dtype : dtype or tuple of dtypes
    """
    tol = _as_tol(dtype, tol)
    o, m, l = (np.asarray(x, dtype=np.float64) for x in (o, m, l))
    ref_o, ref_m, ref_l = (np.asarray(x, dtype=np.float64) for x in (ref_o, ref_m, ref_l))
    assert o.shape == ref_o.shape and m.shape == ref_m.shape and l.shape == ref_l.shape, (
        f"{err_msg} partial shapes o {o.shape} m {m.shape} l {l.shape}, want {ref_o.shape} {ref_m.shape} {ref_l.shape}")
    empty = np.isneginf(ref_m)
    if empty.any():
        assert np.isneginf(m[empty]).all(), f"{err_msg} an empty edge must have m = -inf (R14), got {m[empty].tolist()}"
        assert (l[empty] == 0).all(), f"{err_msg} an empty edge must have l = 0 (R14), got {l[empty].tolist()}"
        assert (o[empty] == 0).all(), f"{err_msg} an empty edge must have o = 0 (R14)"
    live = ~empty
    if not live.any():
        return
    assert np.isfinite(m[live]).all() and np.isfinite(l[live]).all() and np.isfinite(o[live]).all(), (
        f"{err_msg} partials of non-empty edges must be finite")
    dm = np.abs(m[live] - ref_m[live])
    lim_m = tol.lse_limit(ref_m[live])
    assert (dm <= lim_m).all(), f"{err_msg} m differs by {float(dm.max()):.4g} (R14, tolerance {tol})"
    dl = np.abs(l[live] - ref_l[live]) / ref_l[live]
    assert (dl <= tol.out).all(), (
        f"{err_msg} l differs by {float(dl.max()):.4g} relative (R14, tolerance {tol.out:.3g})")
    vscale = float(np.abs(ref_o[live] / ref_l[live][..., None]).max())
    do = np.abs(o[live] - ref_o[live]) / ref_l[live][..., None]
    assert (do <= tol.out_limit(vscale)).all(), (
        f"{err_msg} o differs by {float(do.max()):.4g} x l (R14, limit {tol.out_limit(vscale):.3g}: {tol})")
