"""Device arrays of the wgpu backend other than paged caches: queries, selections, outputs (R30).

A ``WgpuTensor`` is one dense C-ordered array in one device buffer (or a range of one). The
results of a device-resident call (``out``, ``lse``) share one buffer per call: ``out`` as
float32, the combine's ``(m, l)`` pairs for ``lse`` (``lse = m + ln l``, ``-inf`` where ``l = 0``,
turned into natural-log LSE when read), and the call's R6 error words of a device-resident
selection, which every read checks first (R31): a selection that broke R6 raises
``SpecError`` when its results first reach the host.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from ..._types import DeviceArray
from ...errors import DeviceError, SpecError
from ._device import destroy_all, device_errors
from ._webgpu import BufferUsage

__all__ = ["CallResult", "WgpuTensor", "error_message"]

ERR_RANGE = 1
ERR_DUPLICATE = 2


def error_message(fn: str, bits: int, first_row_word: int, num_kv_heads: int, msb: int) -> str:
    """The SpecError text of the R6 error words written by ``psa_invert.wgsl``."""
    row = 0xFFFFFFFF - int(first_row_word)
    t, h = divmod(row, max(1, num_kv_heads))
    what = []
    if bits & ERR_RANGE:
        what.append(f"a block id outside [-1, msb={msb})")
    if bits & ERR_DUPLICATE:
        what.append("a repeated block id")
    return (f"{fn}(): the device-resident selected has {' and '.join(what)}; first in row [{t}, {h}]. "
            "Ids must lie in [-1, msb) and be unique per row; the results of this call are not "
            "attention [R6]")


class WgpuTensor(DeviceArray):
    """A dense array held by a ``WgpuBackend``.

    Made by ``backend.asarray(x)`` (a copy of a host array) or returned by a device-resident
    call. ``numpy()`` copies it back to the host.

    Attributes
    ----------
    shape : tuple of int
    dtype : numpy.dtype
    backend : WgpuBackend
    """

    def __init__(self, backend: Any, buffer: Any, shape: tuple, dtype: Any, *, offset: int = 0,
                 generation: int, owner: CallResult | None = None, label: str = "array"):
        self.backend = backend
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self._buffer = buffer
        self._offset = int(offset)
        self._generation = generation
        self._owner = owner
        self._label = label
        if owner is None:  # a call's results are freed with their CallResult
            self._finalizer = weakref.finalize(self, destroy_all, [buffer])
            self._finalizer.atexit = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # (np.prod of a tuple costs ~10 us on a host)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def buffer(self) -> Any:
        """The device buffer; raises DeviceError when released or from a lost device."""
        if self._buffer is None or (self._owner is not None and self._owner.released):
            raise DeviceError(f"wgpu backend: {self._label} was released")
        if self._generation != self.backend._generation:
            raise DeviceError(f"wgpu backend: {self._label} belongs to a device that was lost or closed")
        return self._buffer

    @property
    def offset(self) -> int:
        return self._offset

    def numpy(self) -> np.ndarray:
        """Copy to the host (waits for the work that writes it). Raises SpecError (R6) if the
        call that made it ran on a device-resident selection that broke R6."""
        if self._owner is not None:
            return self._owner.read(self)
        if self.nbytes == 0:
            self.buffer()  # (released or lost: raise as for any other read)
            return np.zeros(self.shape, dtype=self.dtype)
        with self.backend._lock:
            raw = self.backend._read_range(self.buffer(), self._offset, self.nbytes)
        return raw.view(self.dtype).reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def release(self) -> None:
        """Free the device memory now (also happens when the array is garbage collected)."""
        if self._owner is not None:
            self._owner.release()
            return
        with self.backend._lock:
            self._buffer = None
        self._finalizer()

    @property
    def released(self) -> bool:
        return self._buffer is None or (self._owner is not None and self._owner.released)

    def __repr__(self) -> str:
        state = "released" if self.released else "on device"
        return f"<WgpuTensor {self._label} shape={self.shape} dtype={self.dtype.name} {state}>"


class CallResult:
    """The one buffer of a device-resident call's results: out | (m, l) | error words.

    Parameters
    ----------
    backend : WgpuBackend
    buffer : GPUBuffer
    Tq, Hq, D : int
    fn : str
        The public function, for messages.
    num_kv_heads, msb : int
        For the R6 message.
    """

    def __init__(self, backend, buffer, Tq: int, Hq: int, D: int, *, fn: str, num_kv_heads: int, msb: int,
                 generation: int, recycle=None, reader=None, batch=None):
        self.backend = backend
        self._batch = batch  # the open batch that recorded the call's work (R36), or None
        self._buffer = buffer
        self.rows = Tq * Hq
        self.o_bytes = self.rows * D * 4
        self.ml_bytes = self.rows * 8
        self.err_offset = self.o_bytes + self.ml_bytes
        self.fn, self.num_kv_heads, self.msb = fn, num_kv_heads, msb
        # (buffer, [(offset, nbytes), ...]) -> one uint8 array per range: the plan's readback
        # buffer (one copy, one submit, one map per read); else a read through the backend
        self._reader = reader
        # ``recycle``: the plan takes the buffer back for a later call once nothing refers to
        # these results (queue order makes the reuse safe); else it is destroyed
        self._finalizer = (weakref.finalize(self, recycle, buffer) if recycle is not None
                           else weakref.finalize(self, destroy_all, [buffer]))
        self._finalizer.atexit = False
        self._shapes = {"out": (Tq, Hq, D), "lse": (Tq, Hq)}
        self._generation = generation

    def tensors(self) -> tuple[WgpuTensor, WgpuTensor]:
        """``(out, lse)``: views of the buffer that keep this result alive (it does not keep them:
        no reference cycle, so the buffer goes back to its plan as soon as both are dropped)."""
        b, g = self._buffer, self._generation
        return (WgpuTensor(self.backend, b, self._shapes["out"], np.float32, generation=g, owner=self, label="out"),
                WgpuTensor(self.backend, b, self._shapes["lse"], np.float32, offset=self.o_bytes, generation=g,
                           owner=self, label="lse"))

    @staticmethod
    def nbytes(Tq: int, Hq: int, D: int) -> int:
        return Tq * Hq * D * 4 + Tq * Hq * 8 + 16

    @property
    def released(self) -> bool:
        return self._buffer is None

    def release(self) -> None:
        with self.backend._lock:
            self._buffer = None
        self._finalizer()

    def _read(self, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        """Byte ranges of the result buffer, each copied once into a host array (not kept: a
        second ``.numpy()`` reads again rather than holding a host copy of every result)."""
        if self._buffer is None:
            raise DeviceError(f"wgpu backend: the results of {self.fn}() were released")
        with self.backend._lock:
            if self._generation != self.backend._generation:
                raise DeviceError(f"wgpu backend: the results of {self.fn}() belong to a device that was "
                                  "lost or closed")
            if self._batch is not None and self._batch.failed is not None:
                exc = self._batch.failed
                raise DeviceError(f"wgpu backend: the work of this {self.fn}() call was recorded with later calls "
                                  f"and dropped when one of them failed ({type(exc).__name__}: {exc}); its results "
                                  "were never computed [R36]")
            if self._reader is not None:
                return self._reader(self._buffer, ranges)
            return [self.backend._read_range(self._buffer, off, n) for off, n in ranges]

    def read(self, t: WgpuTensor) -> np.ndarray:
        """``t`` (this call's ``out`` or ``lse``) on the host, after the R6 check of the call's
        device-resident selection (R31): the error words come back with the data."""
        rng = (0, self.o_bytes) if t._label == "out" else (self.o_bytes, self.ml_bytes)
        data, err = self._read([rng, (self.err_offset, 8)])
        err = err.view(np.uint32)
        if int(err[0]):
            raise SpecError(error_message(self.fn, int(err[0]), int(err[1]), self.num_kv_heads, self.msb), "R6")
        if t._label == "out":
            return data.view(np.float32).reshape(t.shape)
        return lse_from_ml(data.view(np.float32).reshape(-1, 2)).reshape(t.shape)


def lse_from_ml(ml: np.ndarray) -> np.ndarray:
    """Natural-log LSE from the combine's ``(m, l)`` rows: ``m + ln l`` in float32, as the
    reference's combine forms it (``_combine.py``), ``-inf`` where ``l = 0`` (a NaN ``l``, from
    NaN or Inf in attended data, gives NaN, as in the reference)."""
    l = ml[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(l)
        np.add(ml[:, 0], lse, out=lse)  # (m first: the NaN a NaN m gives is m's)
    lse[l == 0] = -np.inf
    return lse


def upload(backend, ctx, x: np.ndarray, label: str) -> WgpuTensor:
    """A WgpuTensor holding a copy of host array ``x`` (any dtype numpy can view as bytes)."""

    arr = np.ascontiguousarray(x)
    raw = arr.reshape(-1).view(np.uint8)
    pad = max(16, raw.nbytes + (-raw.nbytes) % 4)
    usage = BufferUsage.STORAGE | BufferUsage.COPY_SRC | BufferUsage.COPY_DST
    with device_errors(f"upload of {label}", bytes=raw.nbytes):
        buf = ctx.device.create_buffer(size=pad, usage=usage, label=label)
        if raw.nbytes % 4:  # writes move whole 4-byte words: pad a float16 or int8 array's tail
            raw = np.concatenate([raw, np.zeros(-raw.nbytes % 4, np.uint8)])
        if raw.nbytes:
            ctx.device.queue.write_buffer(buf, 0, raw)
    return WgpuTensor(backend, buf, arr.shape, arr.dtype, generation=backend._generation, label=label)
