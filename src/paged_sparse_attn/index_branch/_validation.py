"""Input checks of the index branch (R21, R23, R25), each raising SpecError with its rule id.

The layout arrays (``block_tables``, ``cu_seqlens_q``, ``used_kv_lens``, ``block_size``) are
checked by the package's own helpers, so they fail with the same messages and rule ids (R2-R5)
as in ``forward()``. Nothing here casts lossily: float16/bfloat16 scores widen exactly to
float32; float64 scores are refused rather than rounded (rounding could create ties, R24).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .._index import local_blocks, query_positions
from .._types import AttentionInputs, DeviceArray
from .._validation import (
    FLOAT_DTYPES,
    NO_SELECTION,
    _fail,
    as_array,
    check_block_size,
    check_capacity,
    check_causal,
    check_float_array,
    check_int_array,
    cache_dims,
    check_cache_layout,
    check_kv_layout,
    check_layout,
    check_softmax_scale,
)
from ._types import IndexProblem, TopkProblem

__all__ = ["validate_block_scores", "validate_select_topk", "check_topk", "check_cross_shapes"]

_I32_MAX = int(np.iinfo(np.int32).max)


def _float_array(x: Any, fn: str, name: str, ndim: int, shape_doc: str, *, allow_device: bool) -> Any:
    """R21: an ``ndim``-D float array (dtype rule R7), host-only unless ``allow_device``."""
    x = as_array(x, fn, name, "R7")
    if len(x.shape) != ndim:
        raise _fail(fn, f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(x.shape)}", "R21")
    return check_float_array(x, fn, name, ndim, allow_device=allow_device)


def check_cross_shapes(fn: str, index_q: Any, index_k_cache: Any, problem: AttentionInputs) -> None:
    """R25: the index arrays of ``sparse_attention`` must match ``q`` and the paged caches."""
    Tq, Hkv = problem.num_queries, problem.num_kv_heads
    if tuple(index_q.shape[:2]) != (Tq, Hkv):
        raise _fail(fn, f"index_q must have shape [Tq={Tq}, Hkv={Hkv}, d_idx] like q and k_cache, "
                    f"got {tuple(index_q.shape)}", "R25")
    P, S = problem.num_pages, problem.page_size
    Pi, _, Si, _ = cache_dims(index_k_cache.shape, problem.kv_layout)
    if (Pi, Si) != (P, S):
        want = f"[P={P}, Hk_idx, S={S}, d_idx]" if problem.kv_layout == "HND" else f"[P={P}, S={S}, Hk_idx, d_idx]"
        raise _fail(fn, f"index_k_cache must be paged like k_cache, {want}, got {tuple(index_k_cache.shape)}", "R25")


def validate_block_scores(fn: str, index_q: Any, index_k_cache: Any, block_tables: Any, cu_seqlens_q: Any,
                          used_kv_lens: Any, *, block_size: Any, softmax_scale: Any, causal: Any,
                          like: AttentionInputs | None = None, kv_layout: Any = "HND") -> IndexProblem:
    """Validate the inputs of ``block_scores`` (R21, and R2-R5/R7/R8 for the shared arguments).

    ``like`` is the validated forward problem of ``sparse_attention``: the index arrays are then
    also checked against it (R25) before anything else about them.
    """
    kv_layout = check_kv_layout(like.kv_layout if like is not None else kv_layout, fn)
    iq = _float_array(index_q, fn, "index_q", 3, "[Tq, Hkv, d_idx]", allow_device=False)
    ik = _float_array(index_k_cache, fn, "index_k_cache", 4,
                      "[P, Hk_idx, S, d_idx]" if kv_layout == "HND" else "[P, S, Hk_idx, d_idx]", allow_device=True)
    check_cache_layout(ik, fn, "index_k_cache", kv_layout)
    if like is not None:
        check_cross_shapes(fn, iq, ik, like)
    Tq, Hkv, d = iq.shape
    P, Hk, S, dk = cache_dims(ik.shape, kv_layout)
    if Hkv < 1:
        raise _fail(fn, f"index_q must have at least one KV head, got shape {tuple(iq.shape)}", "R21")
    if d < 1 or dk != d:
        raise _fail(fn, f"index_q d_idx={d} and index_k_cache d_idx={dk} must be equal and >= 1", "R21")
    if Hk not in (1, Hkv):
        raise _fail(fn, f"index_k_cache must have Hk_idx = 1 or Hkv={Hkv} index key heads, got {Hk}", "R21")
    if S < 1:
        raise _fail(fn, f"index_k_cache page size (axis {2 if kv_layout == 'HND' else 1}, kv_layout={kv_layout!r}) "
                    f"must be >= 1, got shape {tuple(ik.shape)}", "R21")
    # spec: R21 -- paged like k_cache: the layout rules R2-R5 apply unchanged
    bt, cu, lens, _, bs = check_layout(
        fn, block_tables, cu_seqlens_q, used_kv_lens, NO_SELECTION,
        block_size=block_size, page_size=S, num_pages=P, num_queries=Tq, num_kv_heads=Hkv,
    )
    scale = check_softmax_scale(softmax_scale, d, fn)  # default 1/sqrt(d_idx)
    c = check_causal(causal, fn)
    seq, end = query_positions(cu, lens, c)
    return IndexProblem(  # index_q as given: widened when a backend reads .index_q (R7)
        index_q_input=iq, index_k_cache=ik, block_tables=bt, cu_seqlens_q=cu, used_kv_lens=lens,
        query_seq=np.ascontiguousarray(seq, dtype=np.int32),
        query_end=np.ascontiguousarray(end, dtype=np.int32),
        block_size=bs, softmax_scale=scale, causal=c, kv_layout=kv_layout,
    )


def check_topk(topk: Any, fn: str, *, force_local: bool) -> int:
    """R23: ``topk`` is an int in ``[0, 2**31 - 1]``, and ``>= 1`` with ``force_local``."""
    if isinstance(topk, (bool, np.bool_)) or topk is None:
        raise _fail(fn, f"topk must be a non-negative int, got {topk!r}", "R23")
    try:
        k = operator.index(topk)
    except TypeError:
        raise _fail(fn, f"topk must be a non-negative int, got {topk!r}", "R23") from None
    if k < 0 or k > _I32_MAX:
        raise _fail(fn, f"topk must be an int in [0, {_I32_MAX}], got {k}", "R23")
    if force_local and k < 1:
        raise _fail(fn, "topk must be >= 1 with force_local=True (the local block takes a slot), got 0", "R23")
    return k


def _check_scores(scores: Any, fn: str) -> np.ndarray:
    """R23: float32 (or float16/bfloat16, widened exactly) [Tq, Hkv, msb] with msb >= 1."""
    x = as_array(scores, fn, "scores", "R23")
    if isinstance(x, DeviceArray):
        raise _fail(fn, f"scores must be a host array, got a device array of {x.backend!r}", "R23")
    if x.ndim != 3:
        raise _fail(fn, f"scores must be 3-D [Tq, Hkv, msb], got shape {x.shape}", "R23")
    if x.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(dt.name for dt in FLOAT_DTYPES)
        hint = "; cast with .astype(np.float32) (rounding may create ties)" if x.dtype == np.float64 else ""
        raise _fail(fn, f"scores must have dtype in ({allowed}), got {x.dtype.name}{hint}", "R23")
    if x.shape[2] < 1:
        raise _fail(fn, f"scores must have msb >= 1 blocks (axis 2), got shape {x.shape}", "R23")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_cu(cu_seqlens_q: Any, fn: str, Tq: int) -> np.ndarray:
    """R3 for ``cu_seqlens_q`` alone (select_topk has no block_tables to take B from)."""
    cu = check_int_array(cu_seqlens_q, fn, "cu_seqlens_q", 1, "R3")
    if cu.shape[0] < 1:
        raise _fail(fn, "cu_seqlens_q must have B+1 >= 1 entries, got 0", "R3")
    if cu[0] != 0:
        raise _fail(fn, f"cu_seqlens_q[0] must be 0, got {int(cu[0])}", "R3")
    d = np.diff(cu)
    if (d < 0).any():
        j = int(np.argmax(d < 0))
        raise _fail(fn, f"cu_seqlens_q must be non-decreasing, got {int(cu[j])} then {int(cu[j + 1])} at [{j}, {j + 1}]", "R3")
    if int(cu[-1]) != Tq:
        raise _fail(fn, f"cu_seqlens_q[-1] must equal Tq={Tq}, got {int(cu[-1])}", "R3")
    return cu


def _check_lens(used_kv_lens: Any, fn: str, B: int, cap: int) -> np.ndarray:
    """R4 for ``used_kv_lens`` against ``msb * block_size``; default ``msb * block_size``."""
    if used_kv_lens is None:
        return np.full(B, cap, dtype=np.int32)
    lens = check_int_array(used_kv_lens, fn, "used_kv_lens", 1, "R4")
    if lens.shape[0] != B:
        raise _fail(fn, f"used_kv_lens must have B={B} entries, got {lens.shape[0]}", "R4")
    bad = (lens < 0) | (lens.astype(np.int64) > cap)
    if bad.any():
        j = int(np.argmax(bad))
        raise _fail(fn, f"used_kv_lens[{j}]={int(lens[j])} is outside [0, msb*block_size={cap}]", "R4")
    return lens


def validate_select_topk(fn: str, scores: Any, topk: Any, *, force_local: Any, cu_seqlens_q: Any,
                         used_kv_lens: Any, block_size: Any) -> TopkProblem:
    """Validate the inputs of ``select_topk`` (R23) and compute the local blocks (R24).

    ``cu_seqlens_q``, ``used_kv_lens`` and ``block_size`` are required with ``force_local`` and
    validated whenever given (``used_kv_lens`` then needs the other two to be checked against).
    """
    sc = _check_scores(scores, fn)
    if not isinstance(force_local, (bool, np.bool_)):
        raise _fail(fn, f"force_local must be a bool, got {force_local!r}", "R23")
    force_local = bool(force_local)
    k = check_topk(topk, fn, force_local=force_local)
    Tq, _, msb = sc.shape
    if force_local:
        missing = [n for n, v in (("cu_seqlens_q", cu_seqlens_q), ("block_size", block_size)) if v is None]
        if missing:
            raise _fail(fn, f"force_local=True needs {' and '.join(missing)} to locate each query's own "
                        "block; pass them or force_local=False", "R23")
    elif used_kv_lens is not None and (cu_seqlens_q is None or block_size is None):
        raise _fail(fn, "used_kv_lens is given without cu_seqlens_q and block_size to check it against", "R23")
    cu = _check_cu(cu_seqlens_q, fn, Tq) if cu_seqlens_q is not None else None
    bs = check_block_size(block_size, 1, fn) if block_size is not None else None
    if bs is not None:
        check_capacity(msb, bs, fn)  # lengths up to msb * block_size are int32 (R7)
    local = np.full(Tq, -1, dtype=np.int32)
    if cu is not None and bs is not None:
        lens = _check_lens(used_kv_lens, fn, cu.shape[0] - 1, msb * bs)
        if force_local:
            local = local_blocks(cu, lens, bs)
    return TopkProblem(scores=sc, topk=k, local_block=local, force_local=force_local)
