"""Device-resident memory of the wgpu backend: paged caches on the device (upload, page
updates, readback) and the accounting of ``max_device_bytes``.

:class:`ResidentMixin` is part of :class:`~paged_sparse_attn.backends.wgpu.WgpuBackend`; it uses
the backend's device, lock and generation.
"""

from __future__ import annotations

import numpy as np

from ...errors import DeviceError, SpecError, UnsupportedError
from ._arrays import CacheLayout, WgpuArray, upload_slabs
from ._device import DeviceContext, device_errors
from ._plan import BatchPlan, Geometry

__all__ = ["ResidentMixin", "MERGE_WG", "MERGE_WIDE", "alloc_bytes", "layout_bytes", "merge_constants", "merge_split"]

MERGE_WG = 64


# invocations a combine must keep to take several components each: below, one component each
MERGE_WIDE = 1 << 20


def merge_constants(D: int, rows: int) -> dict[str, int]:
    """Override constants of psa_merge.wgsl for head dim ``D`` and ``rows`` destination rows (the
    largest dispatch of the call): DV = 4 components per invocation where D allows and the
    dispatch stays wide (more loads in flight per invocation), else 2, else 1. Measured on an
    H200: the prefill combine (131072 rows of 128) 0.50 -> 0.42 ms with DV = 4; the decode
    combine (1024 rows) about 2 us slower through Dawn with it (101.3 against 103.4 us with its
    partials), unchanged through wgpu-native. The same bits either way."""
    dv = 1
    for c in (4, 2):
        if D % c == 0 and rows * D // c >= MERGE_WIDE:
            dv = c
            break
    return {"D": D, "WG": MERGE_WG, "DV": dv}


def merge_split(D: int, plans, max_per_dim: int) -> tuple[dict[str, int], int]:
    """The combine of a host-planned call's batches ``plans``: its override constants (one
    pipeline for every batch, sized by the largest) and the destinations per dispatch (within
    ``max_per_dim``² workgroups, and ``dest * D`` within 2^30). Used by ``_execute`` and
    mirrored by ``_call_bytes`` through this one function."""
    mc = merge_constants(D, max((bp.n_dest for bp in plans), default=0))
    lanes = D // mc["DV"]  # invocations per destination
    return mc, max(1, min(max_per_dim * max_per_dim * MERGE_WG // lanes, (1 << 30) // D))


def alloc_bytes(nbytes: int) -> int:
    """Bytes of a buffer made for ``nbytes`` of data (at least 16, a multiple of 4)."""
    nbytes = int(nbytes)
    return max(16, nbytes + (-nbytes) % 4)


def layout_bytes(layout: CacheLayout) -> int:
    """Device bytes of one cache (K or V) in ``layout``, as ``upload_slabs`` allocates it."""
    n = np.diff(layout.chunk_starts.astype(np.int64))
    return int(np.maximum(16, n * layout.slab_bytes).sum())


class ResidentMixin:
    """Caches held on the device between calls, and the device-memory budget."""

    # --- device-resident caches --------------------------------------------------------------------

    def _check_cache_dtype(self, dtype: np.dtype, fn: str) -> None:
        name = np.dtype(dtype).name
        if name not in self.capabilities.dtypes:
            extra = " (the device lacks the shader-f16 feature)" if name == "float16" else ""
            raise UnsupportedError(f"{fn}(): backend 'wgpu' cannot hold a {name} cache{extra}; "
                                   f"supported: {', '.join(self.capabilities.dtypes)} [R18]")

    def upload_kv_cache(self, k_cache, v_cache, *, kv_layout="HND") -> tuple[WgpuArray, WgpuArray]:
        """Copy paged K and V caches ``[P, Hkv, S, D]`` to the device, to reuse across calls.

        Parameters
        ----------
        k_cache, v_cache : array [P, Hkv, S, D], or [P, S, Hkv, D] with ``kv_layout="NHD"``
        kv_layout : {"HND", "NHD"}
            Their page layout (R34); the device holds the pages as they are, and calls that use
            the arrays must name the same layout.

        Returns
        -------
        (WgpuArray, WgpuArray)
            Pass them to :func:`paged_sparse_attn.forward` in place of the numpy caches; update
            pages with :meth:`update_pages`; free with ``.release()``.
        """
        from ..._validation import check_float_array, check_kv_layout

        fn = "upload_kv_cache"
        kvl = check_kv_layout(kv_layout, fn)
        k = check_float_array(k_cache, fn, "k_cache", 4)
        v = check_float_array(v_cache, fn, "v_cache", 4)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise SpecError(f"{fn}(): k_cache and v_cache must have the same shape and dtype, got "
                            f"{k.shape} {k.dtype.name} and {v.shape} {v.dtype.name} [R1]", "R1")
        self._check_cache_dtype(k.dtype, fn)
        with self._lock:
            for attempt in (0, 1):
                try:
                    return self._upload_locked(k, v, fn, kvl)
                except DeviceError:
                    if attempt or not self._device_lost():
                        raise
                    self.close()  # the device was lost: upload to a new one

    def _upload_locked(self, k: np.ndarray, v: np.ndarray, fn: str, kv_layout: str = "HND") -> tuple[WgpuArray, WgpuArray]:
        from ..._validation import cache_dims

        ctx = self._device()
        layout = CacheLayout.make(cache_dims(k.shape, kv_layout), k.dtype, ctx.binding_size, kv_layout=kv_layout)
        self._check_budget(fn, {"k_cache and v_cache": 2 * layout_bytes(layout)})
        kb = upload_slabs(ctx.device, k, layout, "k_cache")
        try:
            vb = upload_slabs(ctx.device, v, layout, "v_cache")
        except BaseException:
            for b in kb:
                b.destroy()
            raise
        ka = WgpuArray(self, layout, kb, self._generation, "k_cache")
        va = WgpuArray(self, layout, vb, self._generation, "v_cache")
        self._resident.update((ka, va))
        return ka, va

    def update_pages(self, k_dev: WgpuArray, v_dev: WgpuArray, page_ids, k_pages, v_pages) -> None:
        """Overwrite whole pages of resident caches (e.g. after appending tokens in a decode loop).

        Parameters
        ----------
        k_dev, v_dev : WgpuArray
            From :meth:`upload_kv_cache`.
        page_ids : int array [n]
            Physical page ids in ``[0, P)``.
        k_pages, v_pages : array [n, Hkv, S, D] ([n, S, Hkv, D] for NHD caches)
            New contents, same dtype and page layout as the caches.
        """
        with self._lock:
            self._write_pages(k_dev, page_ids, k_pages)
            self._write_pages(v_dev, page_ids, v_pages)

    def _own(self, arr: WgpuArray, fn: str) -> None:
        if not isinstance(arr, WgpuArray) or arr.backend is not self:
            raise UnsupportedError(f"{fn}(): expected a WgpuArray of this backend, got {arr!r} [R18]")

    def _write_pages(self, arr: WgpuArray, page_ids, pages) -> None:
        with self._lock:
            self._write_pages_locked(arr, page_ids, pages)

    def _write_pages_locked(self, arr: WgpuArray, page_ids, pages) -> None:
        fn = "update_pages"
        self._own(arr, fn)
        P, Hkv, S, D = arr.layout.shape
        ids = np.asarray(page_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise SpecError(f"{fn}(): page_ids must be a 1-D integer array, got {ids.dtype} {ids.shape} [R2]", "R2")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= P):
            raise SpecError(f"{fn}(): page_ids must lie in [0, {P}), got {ids.min()}..{ids.max()} [R2]", "R2")
        data = np.asarray(pages)
        want = (ids.shape[0], *arr.shape[1:])  # a page in the cache's layout (R34)
        if data.shape != want or data.dtype != arr.dtype:
            raise SpecError(f"{fn}(): pages must be {arr.dtype.name} {list(want)} (kv_layout={arr.kv_layout!r}), "
                            f"got {data.dtype.name} {list(data.shape)} [R1]", "R1")
        lay = arr.layout
        bufs = arr.buffers()
        ctx = self._device()
        # a page's memory as Hkv runs of S rows (its slabs in HND, interleaved rows in NHD): the
        # runs go to the page's consecutive device slabs, so the device holds the page as given
        rows = lay.pad_rows(np.ascontiguousarray(data).reshape(ids.shape[0] * Hkv, S * D))
        gslab = (ids[:, None] * Hkv + np.arange(Hkv)).ravel()
        chunk = np.searchsorted(lay.chunk_starts, gslab, side="right") - 1
        with device_errors(f"{fn} of {arr._label}", pages=int(ids.shape[0])):
            # consecutive slabs of one chunk go in one write
            i = 0
            n = gslab.shape[0]
            while i < n:
                j = i + 1
                while j < n and chunk[j] == chunk[i] and gslab[j] == gslab[j - 1] + 1:
                    j += 1
                off = (int(gslab[i]) - int(lay.chunk_starts[chunk[i]])) * lay.slab_bytes
                ctx.device.queue.write_buffer(bufs[int(chunk[i])], off, rows[i:j])
                i = j

    def _read_cache(self, arr: WgpuArray) -> np.ndarray:
        self._own(arr, "to_numpy")
        with self._lock:
            ctx = self._device()
            lay = arr.layout
            P, Hkv, S, D = lay.shape
            parts = []
            with device_errors(f"readback of {arr._label}", chunks=lay.n_chunks):
                for c, buf in enumerate(arr.buffers()):
                    n = int(lay.chunk_starts[c + 1] - lay.chunk_starts[c])
                    if n == 0:
                        continue
                    raw = ctx.device.queue.read_buffer(buf, 0, n * lay.slab_bytes)
                    parts.append(lay.unpad_rows(np.frombuffer(raw, dtype=lay.dtype).reshape(n, lay.slab_stride)))
            flat = np.concatenate(parts) if parts else np.zeros((0, S * D), dtype=lay.dtype)
            return flat.reshape(lay.physical_shape).copy()

    # --- device memory accounting (max_device_bytes) ------------------------------------------------

    def _held_bytes(self) -> int:
        """Device bytes held between calls: live resident arrays of this device and the scratch."""
        held = sum(a.device_bytes for a in list(self._resident)
                   if not a.released and a._generation == self._generation)
        sc = self._ctx.scratch if self._ctx is not None else None
        return held + (sum(int(b.size) for b in sc) if sc else 0)

    def _check_budget(self, fn: str, need: dict) -> None:
        """Refuse (R18) before allocating if ``need`` (bytes by purpose) exceeds max_device_bytes."""
        if self._max_bytes is None:
            return
        held = self._held_bytes()
        total = sum(need.values())
        if held + total > self._max_bytes:
            parts = ", ".join(f"{k} {v}" for k, v in need.items() if v)
            raise UnsupportedError(
                f"{fn}(): backend 'wgpu' needs {total} bytes of device memory ({parts}), "
                f"{max(0, self._max_bytes - held)} bytes are available (max_device_bytes={self._max_bytes}, "
                f"{held} held by resident caches and scratch); nothing was allocated. Use fewer queries or "
                "sequences per call, release resident caches, or raise max_device_bytes [R18]")

    def _call_bytes(self, ctx: DeviceContext, plans: list[BatchPlan], geom: Geometry) -> dict:
        """Device bytes :meth:`_execute` allocates for ``plans`` (mirrors its buffers)."""
        D, G = geom.D, geom.G
        maxdim = ctx.workgroups_per_dim
        work = readback = 0
        per = merge_split(D, plans, maxdim)[1]
        for bp in plans:
            nq = (bp.q_rows.stop - bp.q_rows.start) if isinstance(bp.q_rows, slice) else len(bp.q_rows)
            records = sum(-(-count // (maxdim * maxdim)) for _, _, count in bp.dispatches)
            if bp.merge_words is not None:
                records += -(-bp.n_dest // per)
                work += alloc_bytes(bp.merge_words.nbytes)
            work += (alloc_bytes(nq * G * D * 4) + alloc_bytes(bp.plan_words.nbytes) + alloc_bytes(records * ctx.uniform_align)
                     + alloc_bytes(bp.n_dest * D * 4) + alloc_bytes(bp.n_dest * 8))  # outputs
            readback += bp.n_dest * D * 4 + bp.n_dest * 8
        work += alloc_bytes(readback)  # one readback buffer for every result (_transfer)
        rows = max([p.n_prows for p in plans if not p.identity] or [0])
        have = ctx.scratch
        grow = 0
        if rows and (have is None or have[0].size < rows * D * 4 or have[1].size < rows * 8):
            grow = max(16, rows * D * 4) + max(16, rows * 8) - (sum(int(b.size) for b in have) if have else 0)
        return {"call buffers": work, "scratch growth": max(0, grow)}
