"""Tolerances derived from the dtype (R20) and the comparisons the property suite makes.

A correct backend's error against the float64 reference comes from two sources: float32
arithmetic (a D-term dot product per score, a sum over the attended positions, the combine over
edges: a few dozen roundings of ``eps32``), and, for float16 / bfloat16 data, the storage dtype if
the backend computes in it (R20: "to the error that a float16 rounding of K and V produces"). The
tolerance is a multiple of the unit roundoff of the least precise dtype involved; it is relative
to the output scale ``max(1, max |ref|)`` because ``out`` is a convex combination of V rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable

import numpy as np

__all__ = [
    "Tolerance",
    "tolerance",
    "assert_attention_close",
    "assert_partials_close",
    "assert_empty_rows_exact",
]

# Multiples of the unit roundoff (eps) a correct implementation stays within, per dtype.
# float32: 64 eps ~ 7.6e-6, the "~1e-5 relative" of R20 for D <= 64 and a few dozen positions.
# float16 / bfloat16: one rounding of K perturbs a score by ~|score| eps / 2 and of V the output
# by eps / 2; 8 eps covers scores of magnitude up to a few units.
ULPS = {"float32": 64.0, "float16": 8.0, "bfloat16": 8.0}


def _eps(dtype) -> float:
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":  # ml_dtypes: numpy's finfo does not know it
        return 2.0 ** -7
    return float(np.finfo(dt).eps)


@dataclass(frozen=True)
class Tolerance:
    """Relative tolerances: ``out`` to ``max(1, max |ref|)``, ``lse`` to ``max(1, |ref_lse|)``."""

    out: float
    lse: float

    def __str__(self) -> str:
        return f"out {self.out:.3g}, lse {self.lse:.3g}"


def tolerance(*dtypes) -> Tolerance:
    """The R20 tolerance for results computed from data of ``dtypes`` (the least precise wins).

    Parameters
    ----------
    *dtypes : numpy dtypes (or names)
        E.g. ``tolerance(q.dtype, k_cache.dtype)``; a tuple/list is flattened.

    Returns
    -------
    Tolerance
        Never smaller than the float32 tolerance: scores and accumulations are float32 (R12).

    Examples
    --------
    >>> tolerance("float32").out
    7.62939453125e-06
    >>> tolerance("float32", "float16").out
    0.0078125
    """
    flat: list = []
    for d in dtypes:
        flat.extend(d if isinstance(d, (tuple, list)) else [d])
    tol = ULPS["float32"] * _eps(np.float32)
    for d in flat:
        dt = np.dtype(d)
        tol = max(tol, ULPS.get(dt.name, ULPS["float32"]) * _eps(dt))
    return Tolerance(out=tol, lse=tol)


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
        scale = max(1.0, float(np.abs(r[finite]).max())) if finite.any() else 1.0
        err = np.where(finite, np.abs(o - r), 0.0)
        j = np.unravel_index(int(np.argmax(err)), err.shape)
        worst = float(err[j])
        if worst > tol.out * scale:
            t_idx = np.argwhere(sel)[j[0]].tolist()
            raise AssertionError(
                f"{err_msg} max |out - ref| = {worst:.4g} at (t, hq)={t_idx}, d={j[1]}: "
                f"got {o[j]:.9g}, want {r[j]:.9g}; tolerance {tol.out:.3g} x {scale:.3g} "
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
                lim = tol.lse * np.maximum(1.0, np.abs(b[fin]))
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
    lim_m = tol.lse * np.maximum(1.0, np.abs(ref_m[live]))
    assert (dm <= lim_m).all(), f"{err_msg} m differs by {float(dm.max()):.4g} (R14, tolerance {tol.lse:.3g})"
    dl = np.abs(l[live] - ref_l[live]) / ref_l[live]
    assert (dl <= tol.out).all(), (
        f"{err_msg} l differs by {float(dl.max()):.4g} relative (R14, tolerance {tol.out:.3g})")
    vscale = max(1.0, float(np.abs(ref_o[live] / ref_l[live][..., None]).max()))
    do = np.abs(o[live] - ref_o[live]) / ref_l[live][..., None]
    assert (do <= tol.out * vscale).all(), (
        f"{err_msg} o differs by {float(do.max()):.4g} x l (R14, tolerance {tol.out:.3g} x {vscale:.3g})")
