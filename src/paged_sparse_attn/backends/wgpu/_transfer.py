"""The buffers of one wgpu call: pooled device buffers, one mapped readback, cached bind groups.

Host time of a small call (a decode step) went to the number of wgpu operations more than to
the bytes: each ``map_sync`` waits on the device's poll thread (and in READ mode submits an
empty command buffer first), each bind group costs ~50 us of descriptor building, each buffer
creation more. So a call

* takes its buffers from a per-device pool (grown on demand), or makes them and destroys them
  after the call under a device-memory budget (``max_device_bytes``: nothing stays held);
* reads all its results back through one mappable buffer, mapped once;
* reuses bind groups whose buffers and ranges are those of an earlier call (:func:`bind_group`).

Everything here runs under the backend's lock: one call at a time per device.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ._device import destroy_all
from ._webgpu import BufferUsage, MapMode

__all__ = ["CallBuffers", "bind_group", "map_read", "read_ranges", "wait_queue"]

ALIGN = 256  # pooled sizes are rounded up to this (and grown by 1.5x) so that small growth reuses


class CallBuffers:
    """Device buffers of one call.

    Parameters
    ----------
    ctx : DeviceContext
        Holds the pool (``ctx.pool``: one buffer per (label, slot, usage), kept between calls).
    pooled : bool
        False: every buffer is made for this call and destroyed by :meth:`close`.
    """

    def __init__(self, ctx: Any, pooled: bool):
        self.ctx = ctx
        self.pooled = pooled
        self.owned: list = []  # made for this call only: destroyed by close()
        self.mapped: list = []  # mapped by this call: unmapped by close()

    def get(self, nbytes: int, usage: int, label: str, slot: int = 0):
        """A buffer of at least ``max(16, nbytes)`` bytes (rounded up to 4) with ``usage``."""
        need = max(16, int(nbytes) + (-int(nbytes)) % 4)
        dev = self.ctx.device
        if not self.pooled:
            b = dev.create_buffer(size=need, usage=usage, label=label)
            self.owned.append(b)
            return b
        pool = self.ctx.pool
        key = (label, slot, int(usage))
        have = pool.get(key)
        if have is not None and have.size >= need:
            return have
        if have is not None:
            del pool[key]
            have.destroy()
        size = max(need, int(have.size * 3 // 2) if have is not None else 0)
        b = pool[key] = dev.create_buffer(size=size + (-size) % ALIGN, usage=usage, label=label)
        return b

    def upload(self, arr: np.ndarray, usage: int, label: str, slot: int = 0):
        """A buffer (``usage | COPY_DST``) holding ``arr`` (padded to a multiple of 4 bytes).

        ``queue.write_buffer`` is as fast here as one staging buffer for all uploads of a call
        (measured: a pooled one re-mapped between calls, or one mapped at creation per call), and
        simpler: wgpu recycles its staging memory once the submission is done.
        """

        arr = np.ascontiguousarray(arr)
        if arr.nbytes % 4:
            arr = np.concatenate([arr.reshape(-1).view(np.uint8), np.zeros(-arr.nbytes % 4, np.uint8)])
        b = self.get(arr.nbytes, usage | BufferUsage.COPY_DST, label, slot)
        if arr.nbytes:
            self.ctx.device.queue.write_buffer(b, 0, arr)
        return b

    def map_read(self, buf, nbytes: int) -> memoryview:
        """Map ``buf`` (waits for the submitted work) and view its first ``nbytes`` (no copy)."""
        self.mapped.append(buf)
        return map_read(buf, nbytes)

    def close(self) -> None:
        """Unmap what this call mapped and destroy what it made; never raises."""
        for b in self.mapped:  # a pooled readback buffer left mapped by an error would fail the next copy
            try:
                if b.map_state != "unmapped":
                    b.unmap()
            except Exception:
                pass
        destroy_all(self.owned)
        self.mapped, self.owned = [], []


def map_read(buf, nbytes: int) -> memoryview:
    """Map ``buf`` for reading (waits for the submitted work that writes it) and view its first
    ``nbytes`` without a copy; the caller unmaps."""
    global _NOSYNC
    if _NOSYNC:
        try:
            buf.map_sync("READ_NOSYNC", 0, nbytes)
        except (ValueError, KeyError, TypeError, AttributeError):  # a wgpu-py without it: checked before mapping
            _NOSYNC = False
    if not _NOSYNC:

        buf.map_sync(MapMode.READ, 0, nbytes)
    return buf.read_mapped(0, nbytes, copy=False)


def read_ranges(device: Any, src: Any, ranges: list[tuple[int, int]], rb: Any) -> list[np.ndarray]:
    """Byte ranges ``(offset, nbytes)`` of buffer ``src`` (COPY_SRC; offsets and sizes whole
    4-byte words) as new uint8 arrays: the ranges are copied one after another into the mappable
    buffer ``rb`` in one submission, ``rb`` is mapped once (which waits for the work that writes
    ``src``) and each range copied once out of it. ``rb`` is left unmapped."""
    total = sum(n for _, n in ranges)
    enc = device.create_command_encoder(label="paged_sparse_attn.readback")
    at = 0
    for off, n in ranges:
        enc.copy_buffer_to_buffer(src, off, rb, at, n)
        at += n
    device.queue.submit([enc.finish()])
    try:
        mapped = np.frombuffer(map_read(rb, total), dtype=np.uint8)
        out, at = [], 0
        for _, n in ranges:
            out.append(mapped[at:at + n].copy())
            at += n
        return out
    finally:
        if rb.map_state != "unmapped":
            rb.unmap()


# how long a call that waits for its results polls before it blocks (wait_queue_spinning)
SPIN_S = 2e-3


def wait_queue_spinning(ctx: Any, spin_s: float = SPIN_S) -> None:
    """``wait_queue``, polling for up to ``spin_s`` seconds before it blocks.

    A call that returns host results waits for work of a few hundred microseconds; a blocked
    thread then wakes some 25 us after the GPU has finished (measured on an H200 through Dawn: a
    100 us dispatch and its wait took 150 us blocked, 124 us polled), which is why CUDA runtimes
    spin before they yield. Runtimes that cannot poll without blocking (``Runtime.poll_work_done``
    is None: wgpu-native) wait as ``wait_queue`` does.
    """
    poll = ctx.runtime.poll_work_done
    if poll is None or spin_s <= 0:
        wait_queue(ctx)
        return
    poll(ctx.device, spin_s)  # (through the FlushingQueue: the open batch is submitted first)
    ctx.queue_idle = True


def wait_queue(ctx: Any) -> None:
    """Block until the work submitted to ``ctx``'s queue has finished, copying nothing back (R35).

    Dawn waits on the queue itself. wgpu-native (whose ``on_submitted_work_done`` wgpu-py cannot
    call) maps a 4-byte copy submitted after that work: the map waits for the copy's submission,
    and a queue's submissions finish in order. The two 16-byte buffers are made once per device.
    """
    dev = ctx.device
    if ctx.runtime.work_done_wait:
        dev.queue.on_submitted_work_done_sync()
        ctx.queue_idle = True
        return
    if ctx.sync_buffers is None:
        ctx.sync_buffers = (dev.create_buffer(size=16, usage=BufferUsage.COPY_SRC, label="sync.src"),
                            dev.create_buffer(size=16, usage=BufferUsage.MAP_READ | BufferUsage.COPY_DST,
                                              label="sync.rb"))
    src, rb = ctx.sync_buffers
    read_ranges(dev, src, [(0, 4)], rb)
    ctx.queue_idle = True


# wgpu-py maps in READ mode only after submitting an empty command buffer (a workaround for maps
# that precede any submission; ~0.1-0.2 ms on lavapipe); its "READ_NOSYNC" mode skips that. A
# readback here always follows the submission that wrote it, so the sync buys nothing.
_NOSYNC = True


def bind_group(ctx: Any, layout, resources: list[dict], cache: bool):
    """A bind group of ``resources`` (binding i = resources[i]) for ``layout``.

    With ``cache``, a bind group made before for the same layout and the same buffers, offsets
    and sizes is reused (``ctx.bind_groups``, least recently used evicted). Buffers are keyed by
    wgpu's ``uid``, never reused by another buffer, so an entry of a buffer that was destroyed
    (pool growth, released cache) can never be hit again; it only ages out. Pass ``cache=False``
    for calls that bind per-call buffers (they would only fill the cache).
    """
    key = None
    if cache:
        key = (layout.uid, tuple((r["buffer"].uid, r.get("offset", 0), r.get("size")) for r in resources))
        hit = ctx.bind_groups.get(key)
        if hit is not None:
            return hit
    bg = ctx.device.create_bind_group(layout=layout, entries=[
        {"binding": j, "resource": r} for j, r in enumerate(resources)])
    if key is not None:
        ctx.bind_groups[key] = bg
    return bg
