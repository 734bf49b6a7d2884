"""Plan once, run per layer (R32): ``plan_attention`` and ``AttentionPlan``.

A plan validates a batch layout once and asks its backend for a *runtime* (what the backend
prepares for that layout: on the GPU every buffer, bind group and pipeline). Each
``run`` then checks only the per-layer tensors (shapes, dtypes, ownership and
R6 for host selections; O(1) for device arrays) and runs. ``forward()`` keeps a small cache of
plans keyed by the layout, so plain calls on backends with a runtime of their own get the same
path.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ._api import check_capabilities, check_owner
from ._host_runtime import HostRuntime
from ._layout import BatchLayout, layout_of, validate_layout
from ._types import DeviceArray, KVOuterIndex
from ._validation import _fail, cache_dims, check_cache_layout, check_float_array, check_int_array, check_selected
from .errors import UnsupportedError
from .registry import resolve_backend

__all__ = ["plan_attention", "AttentionPlan", "cached_plan", "drop_cached_plans", "forward_plan", "forward_planned"]


def plan_attention(block_tables, cu_seqlens_q, used_kv_lens=None, *, block_size, page_size, num_q_heads,
                   num_kv_heads, head_dim, kv_dtype, topk, causal=False, softmax_scale=None, index_dim=None,
                   num_index_heads=None, index_dtype=None, kv_layout="HND", backend=None) -> "AttentionPlan":
    """Plan block-sparse attention for a batch layout, to run on many layers (R32).

    Parameters
    ----------
    block_tables : int array [B, max_pages]
        Physical page of each logical page, -1 = unmapped (R2).
    cu_seqlens_q : int array [B + 1]
        Query offsets of the sequences (R3).
    used_kv_lens : int array [B], optional
        KV length of each sequence; default ``msb * block_size`` (R4).
    block_size, page_size : int
        Block size (a multiple of the page size, R5) and page size ``S`` of the caches.
    num_q_heads, num_kv_heads, head_dim : int
        ``Hq``, ``Hkv`` and ``D`` of ``q`` [Tq, Hq, D] and the caches [P, Hkv, S, D].
    kv_dtype : dtype
        dtype of ``k_cache`` and ``v_cache`` (float32 or float16; bfloat16 with ml_dtypes).
    topk : int
        Slots per (query, KV head) of ``selected`` [Tq, Hkv, topk].
    causal : bool
        Right-aligned causal mask (R9); default False, as in ``forward``.
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)`` (R8).
    index_dim, num_index_heads, index_dtype : optional
        ``d_idx``, ``Hk_idx`` (1 or ``Hkv``) and dtype of the index branch's ``index_q``
        [Tq, Hkv, d_idx] and ``index_k_cache`` [P, Hk_idx, S, d_idx]: needed by
        ``run_sparse`` only.
    kv_layout : {"HND", "NHD"}
        Page layout of every run's caches and index keys (R34): ``[P, Hkv, S, D]`` (default) or
        ``[P, S, Hkv, D]``.
    backend : str, Backend or None

    Returns
    -------
    AttentionPlan

    Raises
    ------
    SpecError
        The layout breaks R1-R5, R7, R8, R34 (nothing is allocated).
    UnsupportedError
        The backend cannot run this layout (R18).
    """
    fn = "plan_attention"
    lay = validate_layout(fn, block_tables, cu_seqlens_q, used_kv_lens, block_size=block_size,
                          page_size=page_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, kv_dtype=kv_dtype, topk=topk, causal=causal,
                          softmax_scale=softmax_scale, index_dim=index_dim, num_index_heads=num_index_heads,
                          index_dtype=index_dtype, kv_layout=kv_layout)
    be = resolve_backend(backend)
    return AttentionPlan(lay, be)


class AttentionPlan:
    """A batch layout planned on a backend; run it on each layer's tensors (R32).

    Made by ``plan_attention``. Results are those of ``forward`` (and
    ``sparse_attention``) on the same inputs, bit for bit on the same backend.

    Attributes
    ----------
    layout : BatchLayout
    backend : Backend
    """

    def __init__(self, layout: BatchLayout, backend):
        check_capabilities(backend, "plan_attention", dtypes=(layout.kv_dtype,), head_dim=layout.head_dim,
                           page_size=layout.page_size, block_size=layout.block_size, device_arrays=False,
                           kv_layout=layout.kv_layout)
        self.layout = layout
        self.backend = backend
        self._host = HostRuntime(backend, layout)  # the plain path (and the calls a runtime leaves to it)
        self._runtime = backend.make_runtime(layout) or self._host
        self._lock = threading.Lock()
        # device arrays that passed a role's checks (shape, dtype, backend: fixed for a device
        # array's life), so a model's loop over layers checks each tensor once, not per call;
        # host arrays are checked every call (their shape, dtype and values can change)
        self._passed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        L = self.layout
        return (f"<AttentionPlan B={L.num_seqs} Tq={L.num_queries} Hq={L.num_q_heads} Hkv={L.num_kv_heads} "
                f"D={L.head_dim} topk={L.topk} on {self.backend.name!r}>")

    # --- per-layer checks ---------------------------------------------------------------------

    def _known(self, *pairs) -> bool:
        """Whether every ``(role, x)`` is a device array that passed that role's checks before."""
        for role, x in pairs:
            if not isinstance(x, DeviceArray) or role not in self._passed.get(x, ()):
                return False
        return True

    def _remember(self, *pairs) -> None:
        for role, x in pairs:
            if isinstance(x, DeviceArray):
                try:
                    self._passed.setdefault(x, set()).add(role)
                except TypeError:  # a third-party device array that takes no weak reference
                    pass

    def _check_q(self, fn: str, q: Any, name: str = "q", shape: tuple | None = None) -> Any:
        L = self.layout
        want = shape or (L.num_queries, L.num_q_heads, L.head_dim)
        q = check_float_array(q, fn, name, 3, allow_device=True)
        if tuple(q.shape) != want:
            raise _fail(fn, f"{name} must have shape {list(want)} (the plan's layout), got {list(q.shape)}", "R32")
        return q

    def _check_caches(self, fn: str, k: Any, v: Any, names=("k_cache", "v_cache"), heads: int | None = None,
                      dim: int | None = None, dtype: Any = None) -> tuple[Any, Any]:
        L = self.layout
        out = []
        for x, name in zip((k, v), names):
            if x is None:
                out.append(None)
                continue
            x = check_float_array(x, fn, name, 4, allow_device=True)
            check_cache_layout(x, fn, name, L.kv_layout)
            P, H, S, D = cache_dims(x.shape, L.kv_layout)
            want_h = L.num_kv_heads if heads is None else heads
            want_d = L.head_dim if dim is None else dim
            want_dt = L.kv_dtype if dtype is None else dtype
            if H != want_h or S != L.page_size or D != want_d or np.dtype(x.dtype) != want_dt:
                want = ", ".join(map(str, L.cache_shape("P", want_h, want_d)))
                raise _fail(fn, f"{name} must be {np.dtype(want_dt).name} [{want}] (the plan's layout, "
                            f"kv_layout={L.kv_layout!r}), got {np.dtype(x.dtype).name} {list(x.shape)}", "R32")
            if P <= L.max_page:
                raise _fail(fn, f"{name} has {P} pages; block_tables refers to page {L.max_page}", "R2")
            out.append(x)
        return out[0], out[1]

    def _check_selected(self, fn: str, selected: Any) -> Any:
        L = self.layout
        want = (L.num_queries, L.num_kv_heads, L.topk)
        if isinstance(selected, DeviceArray):
            if tuple(selected.shape) != want or np.dtype(selected.dtype) != np.int32:
                raise _fail(fn, f"a device-resident selected must be int32 {list(want)}, got "
                            f"{np.dtype(selected.dtype).name} {list(selected.shape)}", "R6")
            return selected  # values: checked on the device (R31)
        sel = check_int_array(selected, fn, "selected", 3, "R6")
        check_selected(fn, sel, L.num_queries, L.num_kv_heads, L.msb, topk=L.topk)
        return sel

    # --- running ----------------------------------------------------------------------------------

    def run(self, q, k_cache, v_cache, selected, *, return_lse=False):
        """Attention of one layer with a given selection (as ``forward``).

        Parameters
        ----------
        q : array [Tq, Hq, D] or device array of the plan's backend
        k_cache, v_cache : array [P, Hkv, S, D] (or [P, S, Hkv, D] with the plan's
            ``kv_layout="NHD"``; or device-resident caches)
        selected : int array [Tq, Hkv, topk] or an int32 device array
        return_lse : bool

        Returns
        -------
        out : [Tq, Hq, D] float32, lse : [Tq, Hq] float32 (with ``return_lse``)
            numpy arrays, or device arrays of the backend when ``q`` is one (R30).
        """
        fn = "AttentionPlan.run"
        roles = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("selected", selected))
        if self._known(*roles):
            k, v, sel = k_cache, v_cache, selected
        else:
            q = self._check_q(fn, q)
            k, v = self._check_caches(fn, k_cache, v_cache)
            sel = self._check_selected(fn, selected)
            self._check_owner(fn, q, k, v, sel)
            with self._lock:
                self._remember(*roles)
        with self._lock:
            out, lse = self._run(q, k, v, sel)
        return (out, lse) if return_lse else out

    def run_sparse(self, q, k_cache, v_cache, index_q, index_k_cache, *, return_lse=False):
        """The whole MSA layer (as ``sparse_attention``): block scores, top-k with the local
        block, attention; on backends with a device runtime in one submission (R32).

        Parameters
        ----------
        q : array [Tq, Hq, D]
        k_cache, v_cache : array [P, Hkv, S, D]
        index_q : array [Tq, Hkv, d_idx]
        index_k_cache : array [P, Hk_idx, S, d_idx]
        return_lse : bool
        """
        fn = "AttentionPlan.run_sparse"
        L = self.layout
        if L.index_dim is None:
            raise UnsupportedError(f"{fn}(): the plan was made without index_dim; pass index_dim= (and "
                                   "num_index_heads=, index_dtype=) to plan_attention() [R32]")
        if L.topk < 1:
            raise _fail(fn, f"topk must be >= 1 with the forced local block, got {L.topk}", "R23")
        roles = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("index_q", index_q),
                 ("index_k_cache", index_k_cache))
        if self._known(*roles):
            k, v, iq, ik = k_cache, v_cache, index_q, index_k_cache
        else:
            q = self._check_q(fn, q)
            iq = self._check_q(fn, index_q, "index_q", (L.num_queries, L.num_kv_heads, L.index_dim))
            k, v = self._check_caches(fn, k_cache, v_cache)
            ik, _ = self._check_caches(fn, index_k_cache, None, names=("index_k_cache", ""),
                                       heads=L.num_index_heads, dim=L.index_dim, dtype=L.index_dtype)
            self._check_owner(fn, q, k, v, iq, ik)
            with self._lock:
                self._remember(*roles)
        with self._lock:
            out, lse = self._run_sparse(q, k, v, iq, ik)
        return (out, lse) if return_lse else out

    def _run(self, q, k, v, sel):
        """A layer on validated tensors: the backend's runtime, or the plain path it leaves it to."""
        res = self._runtime.run(q, k, v, sel)
        return self._host.run(q, k, v, sel) if res is NotImplemented else res

    def _run_sparse(self, q, k, v, iq, ik):
        res = self._runtime.run_sparse(q, k, v, iq, ik)
        return self._host.run_sparse(q, k, v, iq, ik) if res is NotImplemented else res

    def kvouter_index(self, selected) -> KVOuterIndex:
        """The R13 index of ``selected`` as this plan's runtime builds it (on the device for a
        device runtime; equal to ``build_kvouter_index``, R33)."""
        fn = "AttentionPlan.kvouter_index"
        sel = self._check_selected(fn, selected)
        self._check_owner(fn, sel)
        with self._lock:
            return self._runtime.kvouter_index(sel)

    def update(self, *, used_kv_lens=None, block_tables=None) -> None:
        """A decode step: new lengths and/or pages, same sequences and shapes (R32).

        Only what changed is sent to the device; buffers, bind groups and pipelines are kept.
        """
        fn = "AttentionPlan.update"
        L = self.layout
        bt = L.block_tables if block_tables is None else block_tables
        lens = L.used_kv_lens if used_kv_lens is None else used_kv_lens
        new = validate_layout(fn, bt, L.cu_seqlens_q, lens, block_size=L.block_size, page_size=L.page_size,
                              num_q_heads=L.num_q_heads, num_kv_heads=L.num_kv_heads, head_dim=L.head_dim,
                              kv_dtype=L.kv_dtype, topk=L.topk, causal=L.causal, softmax_scale=L.softmax_scale,
                              index_dim=L.index_dim, num_index_heads=L.num_index_heads, index_dtype=L.index_dtype,
                              kv_layout=L.kv_layout)
        if new.block_tables.shape != L.block_tables.shape:
            raise _fail(fn, f"block_tables must keep the plan's shape {list(L.block_tables.shape)}, got "
                        f"{list(new.block_tables.shape)}; make a new plan for a new batch", "R32")
        with self._lock:
            self._runtime.update(new)
            if self._host is not self._runtime:
                self._host.update(new)
            self.layout = new
            self._passed.clear()  # a cache that passed may be too small for the new pages (R2)

    def synchronize(self) -> None:
        """Wait until the runs of this plan (and every other call of its backend) have finished
        on the device: ``backend.synchronize()`` (R35)."""
        self.backend.synchronize()

    def close(self) -> None:
        """Release what the runtime holds (device buffers)."""
        with self._lock:
            self._runtime.close()

    def _check_owner(self, fn: str, *arrays) -> None:
        if check_owner(self.backend, fn, *arrays) and not self.backend.capabilities.device_arrays:
            raise UnsupportedError(f"{fn}(): backend {self.backend.name!r} does not accept device arrays [R18]")


# --- the plan cache of forward() ------------------------------------------------------------------

_CACHE_SIZE = 8
_cache: "OrderedDict[tuple, tuple[AttentionPlan, bytes, bytes]]" = OrderedDict()  # plan, its pages, lengths
_cache_lock = threading.Lock()


def _own(layout: BatchLayout) -> tuple[BatchLayout, bytes, bytes]:
    """``layout`` with copies of its page map and lengths (a cached plan outlives the call, and the
    caller may change its arrays in place for the next one), and their bytes."""
    L = layout.layout
    bt, lens = L.block_tables.copy(), L.used_kv_lens.copy()
    return (dataclasses.replace(layout, layout=dataclasses.replace(L, block_tables=bt, used_kv_lens=lens)),
            bt.tobytes(), lens.tobytes())


def drop_cached_plans(backend) -> None:
    """Close and forget the cached plans of ``backend`` (its ``close()`` calls this: their
    device is going, and what they hold, pinned host memory included, goes back now rather than
    when later plans push them out of the cache)."""
    with _cache_lock:
        doomed = [key for key, (plan, _, _) in _cache.items() if plan.backend is backend]
        plans = [_cache.pop(key)[0] for key in doomed]
    for plan in plans:
        plan.close()


def cached_plan(layout: BatchLayout, backend) -> AttentionPlan:
    """The plan of ``layout`` on ``backend`` for ``forward()``: made on first use and kept (least
    recently used evicted past 8), keyed by the layout's structure; a call with new lengths or
    pages updates the kept plan (a decode loop of plain calls reuses one plan)."""
    return _cached(layout.structure_key(), backend, layout.block_tables, layout.used_kv_lens, lambda: layout)


def forward_plan(p, backend) -> AttentionPlan:
    """``cached_plan(layout_of(p), backend)`` for a validated ``Problem``, without building the
    layout when the cache holds its plan with the same pages and lengths (a decode step)."""
    return _cached(problem_key(p), backend, p.block_tables, p.used_kv_lens, lambda: layout_of(p))


def problem_key(p) -> tuple:
    """``layout_of(p).structure_key()``, read off the problem."""
    return (p.block_tables.shape, p.cu_seqlens_q.tobytes(), p.block_size, p.page_size, p.num_q_heads,
            p.num_kv_heads, p.head_dim, p.cache_dtype, p.topk, p.softmax_scale, p.causal, None, None, None,
            p.kv_layout)


def _cached(structure: tuple, backend, block_tables: np.ndarray, used_kv_lens: np.ndarray, layout) -> AttentionPlan:
    key = (id(backend), getattr(backend, "_generation", 0), structure)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[0].backend is backend:
            _cache.move_to_end(key)
        else:
            hit = None
    if hit is not None:
        plan, bt_bytes, lens_bytes = hit
        # compared with the plan's own copies: the caller's arrays may be the ones it had before,
        # changed in place
        if block_tables.tobytes() != bt_bytes or used_kv_lens.tobytes() != lens_bytes:
            own, bt_bytes, lens_bytes = _own(layout())
            with plan._lock:
                plan._runtime.update(own)
                if plan._host is not plan._runtime:
                    plan._host.update(own)
                plan.layout = own
            with _cache_lock:
                if _cache.get(key) is hit:
                    _cache[key] = (plan, bt_bytes, lens_bytes)
        return plan
    own, bt_bytes, lens_bytes = _own(layout())
    plan = AttentionPlan(own, backend)
    with _cache_lock:
        _cache[key] = (plan, bt_bytes, lens_bytes)
        while len(_cache) > _CACHE_SIZE:
            _, (old_plan, _, _) = _cache.popitem(last=False)
            old_plan.close()
    return plan


def forward_planned(q, k_cache, v_cache, block_tables, selected, cu_seqlens_q, *, used_kv_lens, block_size,
                    softmax_scale, causal, kv_layout="HND", backend, return_lse):
    """``forward()`` when ``q`` or ``selected`` is a device array (R30): through a cached plan."""
    fn = "forward"
    from ._validation import check_kv_layout

    kv_layout = check_kv_layout(kv_layout, fn)
    qq = check_float_array(q, fn, "q", 3, allow_device=True)
    k = check_float_array(k_cache, fn, "k_cache", 4, allow_device=True)
    check_cache_layout(k, fn, "k_cache", kv_layout)
    if not isinstance(selected, DeviceArray):
        selected = check_int_array(selected, fn, "selected", 3, "R6")
    if len(selected.shape) != 3:
        raise _fail(fn, f"selected must be 3-D, got shape {list(selected.shape)}", "R6")
    Tq, Hq, D = qq.shape
    P, Hkv, S, Dk = cache_dims(k.shape, kv_layout)
    if Hkv < 1 or Hq < 1 or Hq % Hkv or Dk != D:
        raise _fail(fn, f"q {list(qq.shape)} and k_cache {list(k.shape)} must satisfy Hq % Hkv == 0 and equal "
                    "head_dim", "R1")
    lay = validate_layout(fn, block_tables, cu_seqlens_q, used_kv_lens, block_size=block_size, page_size=S,
                          num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, kv_dtype=k.dtype,
                          topk=int(selected.shape[2]), causal=causal, softmax_scale=softmax_scale,
                          kv_layout=kv_layout)
    if lay.num_queries != Tq:
        raise _fail(fn, f"cu_seqlens_q[-1] must equal Tq={Tq}, got {lay.num_queries}", "R3")
    be = resolve_backend(backend, qq, k, v_cache, selected)
    return cached_plan(lay, be).run(qq, k, v_cache, selected, return_lse=return_lse)
