"""Input validation: one check per rule, each raising SpecError with the rule id (R1-R8, R17, R34).

Validation runs once, in the public functions, before any backend or device work. Nothing here
casts lossily: integer index arrays are converted to int32 only after their values are checked
to fit (R7); float arrays of another dtype are refused, not converted.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from typing import Any

import numpy as np

from ._types import AttentionInputs, DeviceArray, KVOuterIndex, Partials, Problem, SeqLayout
from .errors import SpecError

__all__ = [
    "FLOAT_DTYPES",
    "as_array",
    "check_float_array",
    "check_int_array",
    "check_block_size",
    "check_softmax_scale",
    "check_causal",
    "check_layout",
    "NO_SELECTION",
    "check_capacity",
    "KV_LAYOUTS",
    "check_kv_layout",
    "cache_dims",
    "check_cache_layout",
    "validate_forward",
    "validate_index_inputs",
    "validate_index",
    "validate_partials",
]

_I32 = np.iinfo(np.int32)


def _float_dtypes() -> tuple[np.dtype, ...]:
    dts = [np.dtype(np.float32), np.dtype(np.float16)]
    try:  # bfloat16 only where ml_dtypes provides it (R7)
        import ml_dtypes  # type: ignore

        dts.append(np.dtype(ml_dtypes.bfloat16))
    except Exception:
        pass
    return tuple(dts)


FLOAT_DTYPES = _float_dtypes()


def _fail(fn: str, msg: str, rule: str) -> SpecError:
    return SpecError(f"{fn}(): {msg} [{rule}]", rule)


def as_array(x: Any, fn: str, name: str, rule: str) -> Any:
    """Return ``x`` as a numpy array (no copy when it already is one), or a DeviceArray as is.

    Accepts numpy arrays, anything with ``__array__`` and DLPack producers (torch CPU tensors,
    JAX arrays): those are viewed without a copy where numpy can. Lists and tuples go through
    ``np.asarray`` (Python ints become int64, floats float64: refused for q/k/v by R7). Scalars
    and None are refused.
    """
    if isinstance(x, (np.ndarray, DeviceArray)):
        return x
    if x is None or isinstance(x, (numbers.Number, str, bytes)):
        raise _fail(fn, f"{name} must be an array, got {type(x).__name__}", rule)
    try:
        if isinstance(x, (list, tuple)):  # nested Python sequences: numpy infers the dtype
            return np.asarray(x)
        if hasattr(x, "__dlpack__"):
            try:
                return np.from_dlpack(x)
            except Exception:
                pass  # e.g. a device tensor: try __array__, which raises its own clear error
        if hasattr(x, "__array__"):
            return np.asarray(x)
    except Exception as exc:
        raise _fail(fn, f"{name} could not be read as an array ({type(exc).__name__}: {exc})", rule) from None
    raise _fail(fn, f"{name} must be an array (numpy, __array__ or DLPack), got {type(x).__name__}", rule)


def check_float_array(x: Any, fn: str, name: str, ndim: int, *, allow_device: bool = False) -> Any:
    """Check a float array (R1, R7): ndim, float32/float16 (bfloat16 with ml_dtypes)."""
    x = as_array(x, fn, name, "R7")
    if isinstance(x, DeviceArray):
        if not allow_device:
            raise _fail(fn, f"{name} must be a host array, got a device array of {x.backend!r}", "R1")
    if len(x.shape) != ndim:
        raise _fail(fn, f"{name} must be {ndim}-D, got shape {tuple(x.shape)}", "R1")
    dt = np.dtype(x.dtype)
    if dt not in FLOAT_DTYPES:
        allowed = ", ".join(d.name for d in FLOAT_DTYPES)
        raise _fail(fn, f"{name} must have dtype in ({allowed}), got {dt.name}", "R7")
    if isinstance(x, np.ndarray) and not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)  # a copy, never a cast: values are unchanged
    return x


def check_int_array(x: Any, fn: str, name: str, ndim: int, rule: str) -> np.ndarray:
    """Check an index array (R7): any integer dtype, values fit int32; returns C-contiguous int32."""
    x = as_array(x, fn, name, "R7")
    if isinstance(x, DeviceArray):
        raise _fail(fn, f"{name} must be a host integer array, got a device array", "R7")
    if x.ndim != ndim:
        raise _fail(fn, f"{name} must be {ndim}-D, got shape {x.shape}", rule)
    if x.dtype.kind not in "iu":  # signed or unsigned integers (not bool, kind "b")
        raise _fail(fn, f"{name} must have an integer dtype, got {x.dtype.name}", "R7")
    if x.size and x.dtype.itemsize >= 4 and x.dtype != np.int32:
        lo, hi = int(x.min()), int(x.max())
        if lo < _I32.min or hi > _I32.max:
            bad = lo if lo < _I32.min else hi
            raise _fail(fn, f"{name} values must fit int32, got {bad}", "R7")
    return np.ascontiguousarray(x, dtype=np.int32)


def check_block_size(block_size: Any, page_size: int, fn: str) -> int:
    """R5: block_size is a positive int, a multiple of page_size."""
    if isinstance(block_size, (bool, np.bool_)) or block_size is None:
        raise _fail(fn, f"block_size must be a positive int, got {block_size!r}", "R5")
    try:
        bs = operator.index(block_size)
    except TypeError:
        raise _fail(fn, f"block_size must be a positive int, got {block_size!r}", "R5") from None
    if bs <= 0:
        raise _fail(fn, f"block_size must be a positive int, got {bs}", "R5")
    if page_size <= 0:
        raise _fail(fn, f"page_size must be a positive int, got {page_size}", "R5")
    if bs % page_size:
        raise _fail(fn, f"block_size must be a multiple of page_size={page_size}, got {bs}", "R5")
    return bs


def check_page_size(page_size: Any, fn: str) -> int:
    if isinstance(page_size, (bool, np.bool_)) or page_size is None:
        raise _fail(fn, f"page_size must be a positive int, got {page_size!r}", "R5")
    try:
        s = operator.index(page_size)
    except TypeError:
        raise _fail(fn, f"page_size must be a positive int, got {page_size!r}", "R5") from None
    if s <= 0:
        raise _fail(fn, f"page_size must be a positive int, got {s}", "R5")
    return s


_F32_MAX = float(np.finfo(np.float32).max)


def check_softmax_scale(scale: Any, head_dim: int, fn: str) -> float:
    """R8: a real number (int or float, not bool), finite in float32, any sign; default 1/sqrt(D)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (numbers.Real, np.floating, np.integer)):
        raise _fail(fn, f"softmax_scale must be a finite float, got {scale!r}", "R8")
    value = float(scale)
    # scores are float32 (R12, R26): a scale that is infinite in float32 is not a finite scale
    if not math.isfinite(value):
        raise _fail(fn, f"softmax_scale must be a finite float, got {value}", "R8")
    if abs(value) > _F32_MAX:
        raise _fail(fn, f"softmax_scale must be finite in float32 (|softmax_scale| <= {_F32_MAX:.8g}), "
                    f"got {value:g}", "R8")
    return value


def check_causal(causal: Any, fn: str) -> bool:
    """R8: causal is a bool."""
    if not isinstance(causal, (bool, np.bool_)):
        raise _fail(fn, f"causal must be a bool, got {causal!r}", "R8")
    return bool(causal)


KV_LAYOUTS = ("HND", "NHD")  # R34: [P, Hkv, S, D] (the default) and [P, S, Hkv, D]


def check_kv_layout(kv_layout: Any, fn: str) -> str:
    """R34: ``kv_layout`` is exactly ``"HND"`` or ``"NHD"`` (no case folding, no aliases)."""
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise _fail(fn, f'kv_layout must be "HND" ([P, Hkv, S, D]) or "NHD" ([P, S, Hkv, D]), got {kv_layout!r}', "R34")
    return kv_layout


def cache_dims(shape: tuple, kv_layout: str) -> tuple[int, int, int, int]:
    """``(P, Hkv, S, D)`` of a 4-D cache shape read in ``kv_layout`` (R34)."""
    P, a, b, D = (int(x) for x in shape)
    return (P, a, b, D) if kv_layout == "HND" else (P, b, a, D)


def check_cache_layout(x: Any, fn: str, name: str, kv_layout: str) -> None:
    """R34: a device-resident cache holds its pages in one layout; the call must name that one."""
    have = getattr(x, "kv_layout", "HND") if isinstance(x, DeviceArray) else kv_layout
    if have != kv_layout:
        raise _fail(fn, f"{name} is a device array uploaded with kv_layout={have!r}, the call has "
                    f"kv_layout={kv_layout!r}; pass kv_layout={have!r}", "R34")


def check_capacity(msb: int, block_size: int, fn: str) -> None:
    """R7: KV positions and lengths (up to ``msb * block_size``) are int32 values."""
    if msb * block_size > _I32.max:
        raise _fail(fn, f"msb*block_size = {msb}*{block_size} = {msb * block_size} KV positions per "
                    f"sequence must fit int32 (<= {_I32.max})", "R7")


def _first_index(mask: np.ndarray) -> list[int]:
    return [int(i) for i in np.argwhere(mask)[0]]


def check_selected(fn: str, sel: np.ndarray, Tq: int, num_kv_heads: int | None, msb: int,
                   topk: int | None = None) -> None:
    """R6 on an int32 host selection: shape [Tq, Hkv, topk], ids in [-1, msb), unique per row."""
    if sel.shape[0] != Tq or (num_kv_heads is not None and sel.shape[1] != num_kv_heads) or (
            topk is not None and sel.shape[2] != topk):
        hkv = num_kv_heads if num_kv_heads is not None else "Hkv"
        k = "topk" if topk is None else f"topk={topk}"
        raise _fail(fn, f"selected must have shape [Tq={Tq}, Hkv={hkv}, {k}], got {sel.shape}", "R6")
    if sel.size:
        # one pass for the common case: ids + 1 as uint32 lie in [0, msb] exactly when the ids lie
        # in [-1, msb) (an id < -1, or INT32_MAX wrapping, becomes >= 2**31); the exact check below
        # finds the first offender for the message
        if sel.dtype == np.int32 and int((sel + np.int32(1)).view(np.uint32).max()) <= msb:
            _check_unique(fn, sel)
            return
        bad = (sel < -1) | (sel >= msb)
        if bad.any():
            at = _first_index(bad)
            v = int(sel[tuple(at)])
            rel = f">= msb={msb}" if v >= msb else "< -1"
            raise _fail(fn, f"selected contains block id {v} {rel} at {at}", "R6")
        _check_unique(fn, sel)


def _check_unique(fn: str, sel: np.ndarray) -> None:
    """R6: no block id twice in a row of ``sel`` [Tq, Hkv, topk] (int32, C-ordered)."""
    if sel.shape[2] < 2:
        return
    srt = np.sort(sel, axis=2)
    # adjacent equal ids over the flattened rows (contiguous, so cheap); a pair across two rows is
    # not a repeat, so any hit is confirmed row by row below
    flat = srt.reshape(-1)
    eq = flat[1:] == flat[:-1]
    eq &= flat[1:] >= 0
    if not eq.any():
        return
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if dup.any():
        t, h, j = _first_index(dup)
        raise _fail(fn, f"selected row [{t}, {h}] repeats block id {int(srt[t, h, j])}; ids must be unique per row", "R6")


class _Passed:
    """Host index arrays that passed their layout checks lately (what they were checked against,
    dtype, shape and bytes).

    A decode loop passes the same ``block_tables`` (and often the same ``cu_seqlens_q`` and
    ``used_kv_lens``) on every call. The checks are a function of the array's dtype, shape and
    bytes and of the sizes they are checked against (``what``), so an array equal in all of
    these to one that passed needs no second look; comparing the bytes costs a fraction of the
    checks. Only exact ``numpy.ndarray`` inputs are remembered; the array returned is the one
    ``check_int_array`` returns (the caller's own when it is C-contiguous int32).
    """

    def __init__(self, size: int = 4):
        self._size = size
        self._items: tuple = ()  # (what, dtype, shape, bytes), newest first
        self._lock = threading.Lock()

    def get(self, what: tuple, x: Any) -> tuple[np.ndarray | None, bytes | None]:
        """``(x as C-contiguous int32, None)`` if ``x`` passed; else ``(None, bytes of x or None)``."""
        if type(x) is not np.ndarray:
            return None, None
        raw = None
        for w, dt, shape, b in self._items:
            if w == what and dt == x.dtype and shape == x.shape:
                if raw is None:
                    raw = x.tobytes()
                if b == raw:
                    return np.ascontiguousarray(x, dtype=np.int32), None
        return None, (x.tobytes() if raw is None else raw)

    def put(self, what: tuple, x: Any, raw: bytes | None) -> None:
        """Remember that ``x`` (whose bytes ``get`` returned) passed the checks of ``what``."""
        if raw is not None:
            with self._lock:
                self._items = ((what, x.dtype, x.shape, raw),) + self._items[:self._size - 1]


_PASSED = _Passed()


class _NoSelection:
    """The ``selected`` of a call whose selection does not exist yet (layout-only checks)."""

    def __repr__(self) -> str:
        return "NO_SELECTION"


NO_SELECTION: Any = _NoSelection()


def check_layout(
    fn: str,
    block_tables: Any,
    cu_seqlens_q: Any,
    used_kv_lens: Any,
    selected: Any,
    *,
    block_size: Any,
    page_size: Any,
    num_pages: int | None,
    num_queries: int | None,
    num_kv_heads: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Check R2-R6 for the index arrays; returns int32 arrays and block_size.

    ``num_pages`` / ``num_queries`` / ``num_kv_heads`` are None when the caller has no cache or
    queries (build_kvouter_index): then page ids are only checked to be >= -1 and the query
    count and head count come from ``selected``. ``selected=NO_SELECTION`` checks the layout
    alone (R2-R5; ``num_queries`` is then required) and returns None in its place.
    """
    page_size = check_page_size(page_size, fn)
    bs = check_block_size(block_size, page_size, fn)
    ppb = bs // page_size
    # R2, R5, R7 of block_tables: a function of its bytes, the page and block sizes and the pages
    what = ("block_tables", page_size, bs, num_pages)
    bt, raw = _PASSED.get(what, block_tables)
    if bt is None:
        bt = check_int_array(block_tables, fn, "block_tables", 2, "R2")
        max_pages = bt.shape[1]
        msb = max_pages // ppb
        if msb < 1:
            raise _fail(
                fn,
                f"block_tables has {max_pages} pages per row, fewer than one block of "
                f"{ppb} pages (block_size={bs}, page_size={page_size}); msb must be >= 1",
                "R5",
            )
        check_capacity(msb, bs, fn)
        if bt.size:
            bad = bt < -1
            if num_pages is not None:
                bad |= bt >= num_pages
            if bad.any():
                at = _first_index(bad)
                v = int(bt[tuple(at)])
                want = f"-1 or a page id in [0, {num_pages})" if num_pages is not None else "-1 or a page id >= 0"
                raise _fail(fn, f"block_tables contains {v} at {at}, expected {want}", "R2")
        _PASSED.put(what, block_tables, raw)
    B, max_pages = bt.shape
    msb = max_pages // ppb

    what = ("cu_seqlens_q", B)  # R3 but the query count, checked below on every call
    cu, raw = _PASSED.get(what, cu_seqlens_q)
    if cu is None:
        cu = check_int_array(cu_seqlens_q, fn, "cu_seqlens_q", 1, "R3")
        if cu.shape[0] != B + 1:
            raise _fail(fn, f"cu_seqlens_q must have B+1={B + 1} entries (B = block_tables rows), got {cu.shape[0]}", "R3")
        if cu[0] != 0:
            raise _fail(fn, f"cu_seqlens_q[0] must be 0, got {int(cu[0])}", "R3")
        if B and (np.diff(cu) < 0).any():
            j = int(np.argmax(np.diff(cu) < 0))
            raise _fail(fn, f"cu_seqlens_q must be non-decreasing, got {int(cu[j])} then {int(cu[j + 1])} at [{j}, {j + 1}]", "R3")
        _PASSED.put(what, cu_seqlens_q, raw)

    sel = None if selected is NO_SELECTION else check_int_array(selected, fn, "selected", 3, "R6")
    Tq = num_queries if num_queries is not None else sel.shape[0]
    if int(cu[-1]) != Tq:
        raise _fail(fn, f"cu_seqlens_q[-1] must equal Tq={Tq}, got {int(cu[-1])}", "R3")
    if sel is not None:
        check_selected(fn, sel, Tq, num_kv_heads, msb)

    cap = msb * bs
    if used_kv_lens is None:
        lens = np.full(B, cap, dtype=np.int32)
    else:
        what = ("used_kv_lens", B, cap)
        lens, raw = _PASSED.get(what, used_kv_lens)
        if lens is None:
            lens = check_int_array(used_kv_lens, fn, "used_kv_lens", 1, "R4")
            if lens.shape[0] != B:
                raise _fail(fn, f"used_kv_lens must have B={B} entries, got {lens.shape[0]}", "R4")
            bad = (lens < 0) | (lens > cap)
            if bad.any():
                j = int(np.argmax(bad))
                raise _fail(fn, f"used_kv_lens[{j}]={int(lens[j])} is outside [0, msb*block_size={cap}]", "R4")
            _PASSED.put(what, used_kv_lens, raw)
    return bt, cu, lens, sel, bs


def validate_forward(
    fn: str,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    selected: Any,
    cu_seqlens_q: Any,
    *,
    used_kv_lens: Any,
    block_size: Any,
    softmax_scale: Any,
    causal: Any,
    kv_layout: Any = "HND",
) -> AttentionInputs:
    """Validate every input of ``forward`` (R1-R8, R34) and return a ``Problem``.

    ``selected=NO_SELECTION`` (``sparse_attention``, whose selection comes later): the same
    checks without R6, returning the ``AttentionInputs``.
    """
    kv_layout = check_kv_layout(kv_layout, fn)
    q = check_float_array(q, fn, "q", 3)
    k_cache = check_float_array(k_cache, fn, "k_cache", 4, allow_device=True)
    v_cache = check_float_array(v_cache, fn, "v_cache", 4, allow_device=True)
    check_cache_layout(k_cache, fn, "k_cache", kv_layout)
    check_cache_layout(v_cache, fn, "v_cache", kv_layout)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise _fail(fn, f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}", "R1")
    if np.dtype(k_cache.dtype) != np.dtype(v_cache.dtype):
        raise _fail(fn, f"k_cache and v_cache must have the same dtype, got {np.dtype(k_cache.dtype).name} and {np.dtype(v_cache.dtype).name}", "R1")
    Tq, Hq, D = q.shape
    P, Hkv, S, Dk = cache_dims(k_cache.shape, kv_layout)
    h_ax, s_ax = (1, 2) if kv_layout == "HND" else (2, 1)
    if Hkv < 1:
        raise _fail(fn, f"k_cache must have at least one KV head (axis {h_ax}, kv_layout={kv_layout!r}), "
                    f"got shape {tuple(k_cache.shape)}", "R1")
    if S < 1:
        raise _fail(fn, f"k_cache page size (axis {s_ax}, kv_layout={kv_layout!r}) must be >= 1, got shape "
                    f"{tuple(k_cache.shape)}", "R1")
    if D < 1 or Dk != D:
        raise _fail(fn, f"q head_dim {D} and k_cache head_dim {Dk} must be equal and >= 1", "R1")
    if Hq < 1 or Hq % Hkv:
        raise _fail(fn, f"Hq={Hq} must be a positive multiple of Hkv={Hkv}", "R1")
    bt, cu, lens, sel, bs = check_layout(
        fn, block_tables, cu_seqlens_q, used_kv_lens, selected,
        block_size=block_size, page_size=S, num_pages=P, num_queries=Tq, num_kv_heads=Hkv,
    )
    scale = check_softmax_scale(softmax_scale, D, fn)
    layout = SeqLayout(bt, cu, lens, bs, S, check_causal(causal, fn))
    if sel is None:
        return AttentionInputs(q, k_cache, v_cache, layout, scale, kv_layout=kv_layout)
    # q as given (C-contiguous): the record widens it to float32 when a backend reads .q (R7)
    return Problem(q, k_cache, v_cache, layout, scale, sel, kv_layout=kv_layout)


def validate_index_inputs(
    fn: str, selected: Any, block_tables: Any, cu_seqlens_q: Any, used_kv_lens: Any, *,
    block_size: Any, page_size: Any, causal: Any,
) -> tuple[np.ndarray, SeqLayout]:
    """Validate the inputs of build_kvouter_index (R2-R8): ``(selected, layout)``."""
    s = check_page_size(page_size, fn)
    bt, cu, lens, sel, bs = check_layout(
        fn, block_tables, cu_seqlens_q, used_kv_lens, selected,
        block_size=block_size, page_size=s, num_pages=None, num_queries=None, num_kv_heads=None,
    )
    return sel, SeqLayout(bt, cu, lens, bs, s, check_causal(causal, fn))


def validate_index(fn: str, index: Any, *, num_queries: int | None = None, num_kv_heads: int | None = None,
                   page_size: int | None = None, num_pages: int | None = None) -> KVOuterIndex:
    """Check that ``index`` is a KVOuterIndex consistent with the other arguments (R13).

    Besides the sizes the caller knows, every field is checked to be exactly what
    ``build_kvouter_index`` makes of the index's own layout (R2-R5) and edges: int32 arrays of
    the right lengths, ids in range, slot groups and rows consistent with the edges, each edge's
    length equal to the R13 formula. A kernel trusts these arrays as page and position indices
    (the GPU kernels have no other bounds), so an index built by hand or modified after it was
    built must not reach a backend unless it is one ``build_kvouter_index`` could have made.
    """
    if not isinstance(index, KVOuterIndex):
        raise _fail(fn, f"index must be a KVOuterIndex from build_kvouter_index(), got {type(index).__name__}", "R13")
    if not isinstance(index.layout, SeqLayout):
        raise _tampered(fn, f"layout must be a SeqLayout, got {type(index.layout).__name__}")
    if num_queries is not None and index.num_queries != num_queries:
        raise _fail(fn, f"index was built for Tq={index.num_queries} queries, q has {num_queries}", "R13")
    if num_kv_heads is not None and index.num_kv_heads != num_kv_heads:
        raise _fail(fn, f"index was built for Hkv={index.num_kv_heads} KV heads, k_cache has {num_kv_heads}", "R13")
    if page_size is not None and index.page_size != page_size:
        raise _fail(fn, f"index was built for page_size={index.page_size}, k_cache has {page_size}", "R13")
    _check_index_fields(fn, index, num_pages)
    return index


def _tampered(fn: str, what: str) -> SpecError:
    return _fail(fn, f"index.{what}; it was not made by build_kvouter_index() or was modified afterwards", "R13")


def _check_index_fields(fn: str, ix: KVOuterIndex, num_pages: int | None) -> None:
    """R13: every field of ``ix`` in range and consistent (vectorised, O(E + Tq*Hkv + B*max_pages))."""
    from ._index import query_positions

    lay = ix.layout  # a SeqLayout (validate_index checked)
    scalars = {"num_queries": ix.num_queries, "num_kv_heads": ix.num_kv_heads, "block_size": lay.block_size,
               "page_size": lay.page_size}
    for name, v in scalars.items():
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < (0 if name == "num_queries" else 1):
            raise _tampered(fn, f"{name} must be a {'non-negative' if name == 'num_queries' else 'positive'} int, got {v!r}")
    if not isinstance(lay.causal, (bool, np.bool_)):
        raise _tampered(fn, f"causal must be a bool, got {lay.causal!r}")
    Tq, Hkv, bs, S = (int(v) for v in scalars.values())
    arrays = ("edge_query", "edge_head", "edge_seq", "edge_block", "edge_rank", "edge_len", "slot_ptr", "slot_head",
              "slot_seq", "slot_block", "row_ptr", "row_edges")
    layout_arrays = ("block_tables", "cu_seqlens_q", "used_kv_lens")
    for name in arrays + layout_arrays:
        a = getattr(lay if name in layout_arrays else ix, name)
        want_ndim = 2 if name == "block_tables" else 1
        if not isinstance(a, np.ndarray) or a.dtype != np.int32 or a.ndim != want_ndim:
            got = f"{a.dtype.name} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise _tampered(fn, f"{name} must be a {want_ndim}-D int32 array, got {got}")
    # the layout the index was built from: the rules of forward() (R2-R5, R7)
    bt, cu, lens, _, _ = check_layout(fn, lay.block_tables, lay.cu_seqlens_q, lay.used_kv_lens, NO_SELECTION,
                                      block_size=bs, page_size=S, num_pages=num_pages, num_queries=Tq,
                                      num_kv_heads=Hkv)
    msb = lay.msb
    E = ix.edge_query.shape[0]
    for name in ("edge_head", "edge_seq", "edge_block", "edge_rank", "edge_len", "row_edges"):
        if getattr(ix, name).shape[0] != E:
            raise _tampered(fn, f"{name} has {getattr(ix, name).shape[0]} entries, edge_query has E={E}")
    n_slots = ix.slot_head.shape[0]
    if ix.slot_seq.shape[0] != n_slots or ix.slot_block.shape[0] != n_slots or ix.slot_ptr.shape[0] != n_slots + 1:
        raise _tampered(fn, f"slot arrays have inconsistent lengths: slot_ptr {ix.slot_ptr.shape[0]}, slot_head "
                        f"{n_slots}, slot_seq {ix.slot_seq.shape[0]}, slot_block {ix.slot_block.shape[0]}")
    R = Tq * Hkv
    if ix.row_ptr.shape[0] != R + 1:
        raise _tampered(fn, f"row_ptr has {ix.row_ptr.shape[0]} entries, expected Tq*Hkv+1={R + 1}")

    def in_range(name: str, a: np.ndarray, lo: int, hi: int) -> None:
        bad = (a < lo) | (a >= hi)
        if bad.any():
            j = int(np.argmax(bad))
            raise _tampered(fn, f"{name}[{j}]={int(a[j])} is outside [{lo}, {hi})")

    t = ix.edge_query.astype(np.int64)
    h = ix.edge_head.astype(np.int64)
    s = ix.edge_block.astype(np.int64)
    in_range("edge_query", t, 0, max(Tq, 0))
    in_range("edge_head", h, 0, Hkv)
    in_range("edge_block", s, 0, msb)
    in_range("edge_rank", ix.edge_rank, 0, _I32.max)
    seq, hi = query_positions(cu, lens, bool(lay.causal))
    b = ix.edge_seq.astype(np.int64)
    if E and (b != seq[t]).any():
        j = int(np.argmax(b != seq[t]))
        raise _tampered(fn, f"edge_seq[{j}]={int(b[j])}, but query {int(t[j])} belongs to sequence {int(seq[t[j]])}")
    # the positions an edge may attend: exactly those R9 allows (a longer edge would read past
    # L_b or into the causal future; a kept edge attends at least one position)
    want_len = np.minimum(bs, hi[t] - s * bs) if E else np.zeros(0, np.int64)
    bad = (ix.edge_len != want_len) | (want_len < 1)
    if bad.any():
        j = int(np.argmax(bad))
        raise _tampered(fn, f"edge_len[{j}]={int(ix.edge_len[j])} does not match block {int(s[j])} of query "
                        f"{int(t[j])} (expected {int(want_len[j])}; edges of blocks it cannot see must not exist)")
    # edge order (R13): KV head, then slot (b, s), then query t, strictly: no edge twice
    if E > 1:
        d_h, d_b, d_s, d_t = (np.diff(x) for x in (h, b, s, t))
        up = (d_h > 0) | ((d_h == 0) & ((d_b > 0) | ((d_b == 0) & ((d_s > 0) | ((d_s == 0) & (d_t > 0))))))
        if not up.all():
            j = int(np.argmin(up))
            raise _tampered(fn, f"edges {j} and {j + 1} are not in (KV head, sequence, block, query) order or repeat")
    # slot groups: the maximal runs of equal (h, b, s)
    new = np.ones(E, dtype=bool)
    if E > 1:
        new[1:] = (np.diff(h) != 0) | (np.diff(b) != 0) | (np.diff(s) != 0)
    starts = np.flatnonzero(new)
    if not (np.array_equal(ix.slot_ptr[:-1], starts) and int(ix.slot_ptr[-1]) == E):
        raise _tampered(fn, "slot_ptr does not delimit the runs of equal (KV head, sequence, block) edges")
    if not (np.array_equal(ix.slot_head, h[starts]) and np.array_equal(ix.slot_seq, b[starts])
            and np.array_equal(ix.slot_block, s[starts])):
        raise _tampered(fn, "slot_head / slot_seq / slot_block do not match the edges of their slot groups")
    # rows: row_ptr delimits, row_edges lists each edge once, under its own row, in rank order
    rp = ix.row_ptr.astype(np.int64)
    if rp[0] != 0 or rp[-1] != E or (np.diff(rp) < 0).any():
        raise _tampered(fn, f"row_ptr must rise from 0 to E={E}")
    re = ix.row_edges.astype(np.int64)
    in_range("row_edges", re, 0, E)
    if E and (np.bincount(re, minlength=E) != 1).any():
        raise _tampered(fn, "row_edges must list every edge exactly once")
    row_of = np.repeat(np.arange(R, dtype=np.int64), np.diff(rp))
    if E and (t[re] * Hkv + h[re] != row_of).any():
        j = int(np.argmax(t[re] * Hkv + h[re] != row_of))
        raise _tampered(fn, f"row_edges[{j}]={int(re[j])} is listed under row {int(row_of[j])}, not its own")
    if E > 1:
        rank = ix.edge_rank.astype(np.int64)[re]
        same_row = row_of[1:] == row_of[:-1]
        if (same_row & (np.diff(rank) <= 0)).any():
            raise _tampered(fn, "row_edges must list the edges of a row in increasing edge_rank")


def validate_partials(fn: str, partials: Any, index: KVOuterIndex) -> Partials:
    """Check shapes and dtypes of partials against the index (R14)."""
    if not isinstance(partials, Partials):
        raise _fail(fn, f"partials must be a Partials, got {type(partials).__name__}", "R14")
    E = index.num_edges
    o, m, l = (np.asarray(a) for a in (partials.o, partials.m, partials.l))
    if o.ndim != 3 or o.shape[0] != E or m.shape != o.shape[:2] or l.shape != o.shape[:2]:
        raise _fail(fn, f"partials must be o [E={E}, G, D], m and l [E, G]; got o {o.shape}, m {m.shape}, l {l.shape}", "R14")
    for name, a in (("o", o), ("m", m), ("l", l)):
        if a.dtype not in (np.float32, np.float64):
            raise _fail(fn, f"partials.{name} must be float32 or float64, got {a.dtype.name}", "R14")
    if o.shape[1] < 1:
        raise _fail(fn, "partials must have G >= 1 query heads per KV head", "R14")
    return Partials(o, m, l)
