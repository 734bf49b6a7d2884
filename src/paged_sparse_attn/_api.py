"""The public functions: validate -> resolve backend -> check capabilities -> run."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._index import build_index_arrays
from ._outputs import backend_label, checked_out_lse, checked_partials
from ._types import AttentionInputs, Capabilities, DeviceArray, KVOuterIndex, Partials
from ._validation import (
    cache_dims,
    check_cache_layout,
    check_float_array,
    check_kv_layout,
    check_softmax_scale,
    validate_forward,
    validate_index,
    validate_index_inputs,
    validate_partials,
)
from .backends.base import Backend
from .errors import UnsupportedError
from .registry import resolve_backend

__all__ = ["forward", "forward_partials", "combine_partials", "build_kvouter_index", "check_capabilities",
           "check_owner"]


# problems a backend's capabilities were found to allow, by the id of that Capabilities record
# (kept alive by the entry, so the id is not reused); a record is immutable, so a decode loop's
# calls need no second look
_ALLOWED: dict = {}


def check_capabilities(backend: Backend, fn: str, *, dtypes: tuple[np.dtype, ...], head_dim: int,
                       page_size: int, block_size: int, device_arrays: bool, kv_layout: str = "HND") -> None:
    """Raise UnsupportedError (R18) if ``backend`` cannot run a valid problem of this kind."""
    caps: Capabilities = backend.capabilities
    key = (id(caps), tuple(dtypes), head_dim, page_size, block_size, device_arrays, kv_layout)
    if _ALLOWED.get(key) is caps:
        return
    why = None
    for dt in dtypes:
        if np.dtype(dt).name not in caps.dtypes:
            why = f"dtype {np.dtype(dt).name} is not supported (supported: {', '.join(caps.dtypes)})"
    if caps.max_head_dim is not None and head_dim > caps.max_head_dim:
        why = f"head_dim {head_dim} exceeds its maximum {caps.max_head_dim}"
    if caps.max_page_size is not None and page_size > caps.max_page_size:
        why = f"page_size {page_size} exceeds its maximum {caps.max_page_size}"
    if caps.max_block_size is not None and block_size > caps.max_block_size:
        why = f"block_size {block_size} exceeds its maximum {caps.max_block_size}"
    if device_arrays and not caps.device_arrays:
        why = "it does not accept device-resident arrays"
    layouts = getattr(caps, "kv_layouts", ("HND",))
    if kv_layout not in layouts:  # R34: declared, never transposed behind the caller's back
        why = f"kv_layout {kv_layout!r} is not supported (supported: {', '.join(layouts)})"
    if why:
        raise UnsupportedError(f"{fn}(): backend {backend_label(backend)} cannot run this problem: {why} [R18]")
    if len(_ALLOWED) >= 64:
        _ALLOWED.clear()
    _ALLOWED[key] = caps


def check_owner(backend: Backend, fn: str, *arrays: Any) -> bool:
    """R18: device arrays must belong to the backend that runs the call; True if any is one."""
    dev = False
    for a in arrays:
        if isinstance(a, DeviceArray):
            dev = True
            if a.backend is not backend:
                raise UnsupportedError(
                    f"{fn}(): a device array of {a.backend!r} was passed to backend {backend_label(backend)}; "
                    "use the backend that holds it or pass host arrays [R18]")
    return dev


def _run_checks(backend: Backend, fn: str, p: AttentionInputs) -> None:
    dev = check_owner(backend, fn, p.k_cache, p.v_cache)
    # q was widened exactly to float32 by the validation (R7): only the cache dtype is capability-bound
    check_capabilities(backend, fn, dtypes=(p.cache_dtype,), head_dim=p.head_dim,
                       page_size=p.page_size, block_size=p.block_size, device_arrays=dev, kv_layout=p.kv_layout)


def forward(q, k_cache, v_cache, block_tables, selected, cu_seqlens_q, *, used_kv_lens=None,
            block_size, softmax_scale=None, causal=False, kv_layout="HND", backend=None, return_lse=False):
    """Block-sparse attention over a paged KV cache (R9-R11), computed KV-outer (R13-R15).

    Parameters
    ----------
    q : array [Tq, Hq, D], float32, float16 or bfloat16
        Packed queries of all sequences; any R7 dtype, independent of the cache dtype, widened
        exactly to float32 before the backend sees it (R7).
    k_cache, v_cache : array [P, Hkv, S, D] (or [P, S, Hkv, D] with ``kv_layout="NHD"``)
        Paged caches of the same shape and dtype (float32, float16 or bfloat16; S = page size),
        or device-resident handles of the backend.
    block_tables : int array [B, max_pages]
        Physical page of each logical page, -1 = unmapped (R2).
    selected : int array [Tq, Hkv, topk]
        Selected block ids per query and KV head, -1 = empty slot, unique per row (R6).
    cu_seqlens_q : int array [B + 1]
        Query offsets of the sequences (R3).
    used_kv_lens : int array [B], optional
        KV length L_b of each sequence; default ``msb * block_size`` (R4).
    block_size : int
        Positive multiple of the page size (R5).
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``; any finite real of float32 range, zero and negative included (R8).
    causal : bool
        Right-aligned causal mask: query i of T_b sees positions ``<= L_b - T_b + i`` (R9).
        Default False (``block_scores`` and ``sparse_attention`` default to True, R8).
    kv_layout : {"HND", "NHD"}
        Page layout of the caches (R34): ``"HND"`` ``[P, Hkv, S, D]`` (default) or ``"NHD"``
        ``[P, S, Hkv, D]`` (vLLM's and FlashInfer's). Read in place; the results are the same
        bits in both layouts.
    backend : str, Backend or None
        None: the default backend (``"numpy"``, see
        [`use_backend`][paged_sparse_attn.use_backend]), or the backend holding device-resident
        caches.
    return_lse : bool
        Also return the natural-log LSE.

    Returns
    -------
    out : ndarray float32 [Tq, Hq, D]
        0 for queries whose attended set is empty (R11); NaN and Inf as R26 says.
    lse : ndarray float32 [Tq, Hq]
        Only with ``return_lse=True``; -inf for empty sets.

    Raises
    ------
    SpecError
        An input violates R1-R8 or R34 (before any backend work).
    UnsupportedError
        The backend cannot run this valid problem (R18).
    BackendUnavailableError
        The backend is unknown or cannot run here.
    """
    if isinstance(q, DeviceArray) or isinstance(selected, DeviceArray):  # R30: results stay on the device
        return _attention_plan.forward_planned(
            q, k_cache, v_cache, block_tables, selected, cu_seqlens_q, used_kv_lens=used_kv_lens,
            block_size=block_size, softmax_scale=softmax_scale, causal=causal, kv_layout=kv_layout,
            backend=backend, return_lse=return_lse)
    p = validate_forward("forward", q, k_cache, v_cache, block_tables, selected, cu_seqlens_q,
                         used_kv_lens=used_kv_lens, block_size=block_size, softmax_scale=softmax_scale,
                         causal=causal, kv_layout=kv_layout)
    be = resolve_backend(backend, p.k_cache, p.v_cache)
    _run_checks(be, "forward", p)
    if be.plans_forward(p):  # the backend's plan runtime takes this call (R32)
        out, lse = checked_out_lse(be, "forward", _attention_plan.forward_plan(p, be)._run(
            p.q_input, p.k_cache, p.v_cache, p.selected), p.q_input.shape)  # (q as given: R7)
        return (out, lse) if return_lse else out
    index = build_index_arrays(p.selected, p.layout)
    out, lse = checked_out_lse(be, "forward", be.forward(p, index), p.q_input.shape)
    return (out, lse) if return_lse else out


def build_kvouter_index(selected, block_tables, cu_seqlens_q, used_kv_lens=None, *, block_size,
                        page_size, causal=False) -> KVOuterIndex:
    """Invert a selection into the KV-outer edge list (R13).

    Parameters
    ----------
    selected : int array [Tq, Hkv, topk]
    block_tables : int array [B, max_pages]
    cu_seqlens_q : int array [B + 1]
    used_kv_lens : int array [B], optional
    block_size, page_size : int
    causal : bool
        Default False, as in ``forward`` (R8).

    Returns
    -------
    KVOuterIndex
        Edges ordered by KV head, then slot (b, s), then query t; one edge per kept entry
        (a real block, not entirely >= L_b, and with causal not entirely in the future).
    """
    sel, layout = validate_index_inputs(
        "build_kvouter_index", selected, block_tables, cu_seqlens_q, used_kv_lens,
        block_size=block_size, page_size=page_size, causal=causal)
    return build_index_arrays(sel, layout)


def forward_partials(q, k_cache, v_cache, index, *, softmax_scale=None, kv_layout="HND", backend=None) -> Partials:
    """Per-(edge, query head) online-softmax partials (R14).

    Parameters
    ----------
    q : array [Tq, Hq, D]
    k_cache, v_cache : array [P, Hkv, S, D] (or [P, S, Hkv, D] with ``kv_layout="NHD"``; or
        device-resident handles)
    index : KVOuterIndex
        From [`build_kvouter_index`][paged_sparse_attn.build_kvouter_index] with the same page
        size (an index does not depend on the page layout).
    softmax_scale : float, optional
    kv_layout : {"HND", "NHD"}
        Page layout of the caches (R34).
    backend : str, Backend or None

    Returns
    -------
    Partials
        ``o`` float32 [E, G, D], ``m`` float32 [E, G], ``l`` float32 [E, G], in index edge order;
        an edge that attends nothing has ``m = -inf``, ``l = 0``, ``o = 0``.
    """
    fn = "forward_partials"
    kv_layout = check_kv_layout(kv_layout, fn)
    q = check_float_array(q, fn, "q", 3)  # R7: widened to float32 when the backend reads p.q
    k_cache = check_float_array(k_cache, fn, "k_cache", 4, allow_device=True)
    v_cache = check_float_array(v_cache, fn, "v_cache", 4, allow_device=True)
    check_cache_layout(k_cache, fn, "k_cache", kv_layout)
    check_cache_layout(v_cache, fn, "v_cache", kv_layout)
    if tuple(k_cache.shape) != tuple(v_cache.shape) or np.dtype(k_cache.dtype) != np.dtype(v_cache.dtype):
        from ._validation import _fail

        raise _fail(fn, "k_cache and v_cache must have the same shape and dtype, got "
                    f"{tuple(k_cache.shape)} {np.dtype(k_cache.dtype).name} and "
                    f"{tuple(v_cache.shape)} {np.dtype(v_cache.dtype).name}", "R1")
    P, Hkv, S, D = cache_dims(k_cache.shape, kv_layout)
    from ._validation import _fail

    if Hkv < 1 or q.shape[1] < 1 or q.shape[1] % Hkv or q.shape[2] != D or D < 1:
        raise _fail(fn, f"q {q.shape} and k_cache {tuple(k_cache.shape)} must satisfy Hq % Hkv == 0 and equal head_dim >= 1", "R1")
    index = validate_index(fn, index, num_queries=q.shape[0], num_kv_heads=Hkv, page_size=S, num_pages=P)
    scale = check_softmax_scale(softmax_scale, D, fn)
    p = AttentionInputs(q, k_cache, v_cache, index.layout, scale, kv_layout=kv_layout)  # the index's layout, not a copy
    be = resolve_backend(backend, k_cache, v_cache)
    _run_checks(be, fn, p)
    return checked_partials(be, fn, be.forward_partials(p, index), index.num_edges, p.group_size, p.head_dim)


def combine_partials(partials, index) -> tuple[np.ndarray, np.ndarray]:
    """Merge partials into attention (R15).

    Parameters
    ----------
    partials : Partials
        ``o`` [E, G, D], ``m`` [E, G], ``l`` [E, G].
    index : KVOuterIndex
        The index the partials were computed for.

    Returns
    -------
    out : ndarray float32 [Tq, Hq, D]
    lse : ndarray float32 [Tq, Hq]
        Natural log; rows with no non-empty edge give ``out = 0``, ``lse = -inf``.
    """
    index = validate_index("combine_partials", index)
    partials = validate_partials("combine_partials", partials, index)
    from ._combine import combine_partials_numpy

    return combine_partials_numpy(partials, index)


# the plans (their module imports this one's checks: imported last, read at call time)
from . import _attention_plan
