"""Paged caches on the device: slab layout, chunking, upload, page updates and readback."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._types import DeviceArray
from ...errors import DeviceError
from ._device import destroy_all, device_errors
from ._plan import SlabMap, chunk_starts_for
from ._webgpu import BufferUsage

__all__ = ["CacheLayout", "WgpuArray", "upload_slabs"]


@dataclass(frozen=True)
class CacheLayout:
    """How a [P, Hkv, S, D] cache (or a compact subset of its slabs) sits in device buffers.

    A slab is one (page, KV head): S rows of ``row_elems = 4 * ceil(D / 4)`` elements (a row is
    padded to whole vec4s; the padding is never used), ``slab_stride = S * row_elems`` elements.
    Chunk c holds device slabs ``chunk_starts[c]:chunk_starts[c+1]``, one buffer each.

    ``shape`` is the logical ``(P, Hkv, S, D)`` whatever the page layout ``kv_layout`` of the
    host array it mirrors (R34). ``rh`` is the number of KV heads whose rows a device page
    interleaves: 1 when the buffers hold slabs of S contiguous rows, ``Hkv`` when they hold the
    pages of an ``"NHD"`` cache as they are (row ``pos`` of head h of a page is the page's row
    ``pos * Hkv + h``; device slab ``n`` is head ``n % rh`` of the chunk's page ``n // rh``, so
    the slab numbering is unchanged and only the kernels' addressing differs).

    A whole cache (a resident one) is held as it is, in either layout, and cut into chunks of
    whole pages in both layouts. A compact upload (the slabs one call reads) holds slabs of
    contiguous rows in both layouts (``rh = 1``), gathered from the caller's array like any
    compact upload. Either way an ``"NHD"`` cache and the same cache in ``"HND"`` are cut into
    the same chunks at the same pages, so the kernels split the same work the same way and
    the results are the same bits (R34).
    """

    shape: tuple[int, int, int, int]
    dtype: np.dtype
    slab_stride: int
    chunk_starts: np.ndarray
    slab_ids: np.ndarray | None = None  # global slab ids held (compact upload), None = all
    rh: int = 1  # KV heads interleaved in a page's rows: 1 (HND) or Hkv (NHD), R34
    nhd: bool = False  # the page layout the buffers hold (R34); rh > 1 only with Hkv > 1

    @property
    def kv_layout(self) -> str:
        return "NHD" if self.nhd else "HND"

    @property
    def physical_shape(self) -> tuple[int, int, int, int]:
        """The shape of the host array these buffers mirror: [P, Hkv, S, D] or [P, S, Hkv, D]."""
        P, H, S, D = self.shape
        return (P, S, H, D) if self.nhd else (P, H, S, D)

    def kernel_constants(self) -> dict[str, int]:
        """Override constants of the kernels that read this cache: ``RH`` when it is not 1 (an
        HND cache, or an NHD cache of one KV head, gets the pipelines it always had)."""
        return {"RH": self.rh} if self.rh != 1 else {}

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    @property
    def row_elems(self) -> int:
        return self.slab_stride // self.shape[2]

    def pad_rows(self, rows: np.ndarray) -> np.ndarray:
        """[n, S*D] slabs -> [n, slab_stride] in the device dtype, C-contiguous."""
        S, D = self.shape[2], self.shape[3]
        rows = np.asarray(rows)
        if self.row_elems != D:
            n = rows.shape[0]
            out = np.zeros((n, S, self.row_elems), dtype=self.dtype)
            out[:, :, :D] = rows.reshape(n, S, D)
            return out.reshape(n, self.slab_stride)
        return np.ascontiguousarray(rows, dtype=self.dtype)

    def unpad_rows(self, rows: np.ndarray) -> np.ndarray:
        """[n, slab_stride] device slabs -> [n, S*D]."""
        S, D = self.shape[2], self.shape[3]
        n = rows.shape[0]
        return rows.reshape(n, S, self.row_elems)[:, :, :D].reshape(n, S * D)

    @property
    def slab_bytes(self) -> int:
        return self.slab_stride * self.itemsize

    @property
    def n_chunks(self) -> int:
        return int(self.chunk_starts.shape[0]) - 1

    @property
    def device_bytes(self) -> int:
        """Bytes of the device buffers of one cache in this layout, as :func:`upload_slabs` makes them."""
        n = np.diff(self.chunk_starts.astype(np.int64))
        return int(np.maximum(16, n * self.slab_bytes).sum())

    def slab_map(self) -> SlabMap:
        return SlabMap(self.chunk_starts, self.slab_ids)

    def same_as(self, other: CacheLayout) -> bool:
        return (self.shape == other.shape and np.dtype(self.dtype) == np.dtype(other.dtype)
                and self.slab_stride == other.slab_stride and self.rh == other.rh and self.nhd == other.nhd
                and np.array_equal(self.chunk_starts, other.chunk_starts)
                and ((self.slab_ids is None and other.slab_ids is None)
                     or (self.slab_ids is not None and other.slab_ids is not None
                         and np.array_equal(self.slab_ids, other.slab_ids))))

    @staticmethod
    def make(shape, dtype, binding_size: int, slab_ids: np.ndarray | None = None,
             kv_layout: str = "HND") -> CacheLayout:
        """The layout of a cache of logical ``shape`` ``(P, Hkv, S, D)`` in ``kv_layout`` (R34).

        ``slab_ids``: sorted global slab ids to hold (a compact upload), None for all of them.
        """
        P, Hkv, S, D = (int(x) for x in shape)
        dt = np.dtype(dtype)
        stride = S * (-(-D // 4) * 4)
        nhd = kv_layout == "NHD"
        if slab_ids is not None:  # compact: slabs of contiguous rows, whatever the host layout
            starts = chunk_starts_for(int(slab_ids.shape[0]), stride * dt.itemsize, binding_size)
            return CacheLayout((P, Hkv, S, D), dt, stride, starts, slab_ids, 1, nhd)
        # whole: chunks of whole pages in both layouts (the same cut, R34); an HND cache whose
        # page does not fit one binding (but a slab does) is still cut by slabs, as NHD cannot be
        unit = Hkv if nhd or (binding_size // (stride * dt.itemsize)) >= Hkv else 1
        starts = chunk_starts_for(P * Hkv, stride * dt.itemsize, binding_size, unit=unit)
        return CacheLayout((P, Hkv, S, D), dt, stride, starts, None, Hkv if nhd else 1, nhd)


def _slab_rows(arr: np.ndarray, layout: CacheLayout, lo: int, hi: int) -> np.ndarray:
    """Device slabs lo:hi of host cache ``arr`` as a [hi-lo, slab_stride] array in the device dtype.

    ``arr`` is in the layout's page layout (R34). A whole cache is read as runs of S rows: in an
    NHD cache the runs of a page are not its heads' slabs, but the chunks hold whole pages, so the
    device gets the caller's pages as they are. A compact upload gathers the slabs it holds (S
    rows each, strided in an NHD array) into contiguous slabs, as it gathers them from HND."""
    P, Hkv, S, D = layout.shape
    if layout.slab_ids is None:
        rows = arr.reshape(P * Hkv, S * D)[lo:hi]
    elif layout.nhd:
        ids = layout.slab_ids[lo:hi]
        rows = arr.reshape(P, S, Hkv, D)[ids // Hkv, :, ids % Hkv].reshape(ids.shape[0], S * D)
    else:
        rows = arr.reshape(P * Hkv, S * D)[layout.slab_ids[lo:hi]]
    return layout.pad_rows(rows)


def upload_slabs(device, arr: np.ndarray, layout: CacheLayout, label: str) -> list:
    """One storage buffer per chunk holding the slabs of ``arr`` that ``layout`` describes."""

    bufs = []
    usage = BufferUsage.STORAGE | BufferUsage.COPY_DST | BufferUsage.COPY_SRC
    try:
        for c in range(layout.n_chunks):
            lo, hi = int(layout.chunk_starts[c]), int(layout.chunk_starts[c + 1])
            nbytes = max(16, (hi - lo) * layout.slab_bytes)
            with device_errors(f"upload of {label} chunk {c}", bytes=nbytes, chunks=layout.n_chunks):
                buf = device.create_buffer(size=nbytes, usage=usage, label=f"{label}[{c}]")
                bufs.append(buf)
                if hi > lo:
                    device.queue.write_buffer(buf, 0, _slab_rows(arr, layout, lo, hi))
    except BaseException:
        for b in bufs:
            b.destroy()
        raise
    return bufs


class WgpuArray(DeviceArray):
    """A paged K or V cache held by a :class:`WgpuBackend` (see ``WgpuBackend.upload_kv_cache``).

    Attributes
    ----------
    shape : tuple of int
        ``(P, Hkv, S, D)``, or ``(P, S, Hkv, D)`` for an ``"NHD"`` cache.
    kv_layout : str
        ``"HND"`` or ``"NHD"``: the page layout it was uploaded in (R34).
    dtype : numpy.dtype
        float32 or float16.
    backend : WgpuBackend
        The backend whose device holds the data.
    """

    def __init__(self, backend: Any, layout: CacheLayout, buffers: list, generation: int, label: str):
        self.backend = backend
        self.layout = layout
        self.shape = layout.physical_shape
        self.kv_layout = layout.kv_layout
        self.dtype = np.dtype(layout.dtype)
        self._buffers = buffers
        self._generation = generation
        self._label = label
        # destroyed (device memory freed) when released or collected, even while the backend's
        # cached bind groups still refer to the buffers (those would otherwise keep it alive)
        self._finalizer = weakref.finalize(self, destroy_all, buffers)
        self._finalizer.atexit = False

    @property
    def nbytes(self) -> int:
        P, Hkv, S, D = self.shape
        return P * Hkv * S * D * self.dtype.itemsize

    @property
    def released(self) -> bool:
        return self._buffers is None

    @property
    def device_bytes(self) -> int:
        """Device memory the array's buffers hold (0 once released)."""
        return sum(int(b.size) for b in self._buffers) if self._buffers is not None else 0

    def buffers(self) -> list:
        """The chunk buffers; raises DeviceError if released or if the device was replaced."""
        if self._buffers is None:
            raise DeviceError(f"wgpu backend: {self._label} was released")
        if self._generation != self.backend._generation:
            raise DeviceError(
                f"wgpu backend: {self._label} belongs to a device that was lost or closed; upload it again")
        return self._buffers

    def to_numpy(self) -> np.ndarray:
        """Copy the cache back to the host, ``[P, Hkv, S, D]`` (``[P, S, Hkv, D]`` if NHD)."""
        return self.backend._read_cache(self)

    def numpy(self) -> np.ndarray:
        """Copy the cache back to the host, in its layout (as :meth:`to_numpy`)."""
        return self.to_numpy()

    def write_pages(self, page_ids, pages) -> None:
        """Overwrite whole pages: ``pages[i]`` ([Hkv, S, D], or [S, Hkv, D] if NHD) goes to physical
        page ``page_ids[i]``."""
        self.backend._write_pages(self, page_ids, pages)

    def release(self) -> None:
        """Free the device memory now (also happens when the array is garbage collected).

        Waits for a call of the backend in progress on another thread (it may be reading it).
        """
        with self.backend._lock:
            self._buffers = None
        self._finalizer()  # destroys the buffers (once)

    def __repr__(self) -> str:
        state = "released" if self._buffers is None else f"{self.layout.n_chunks} chunk(s)"
        return f"<WgpuArray {self._label} shape={self.shape} dtype={self.dtype.name} {state}>"
