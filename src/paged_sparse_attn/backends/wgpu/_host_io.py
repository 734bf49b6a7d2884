"""Host memory the GPU writes itself: a plan's results for calls with host arrays, on runtimes
that map host memory into buffers (Dawn's ``host-mapped-pointer``).

A ``forward()`` call with host arrays otherwise copies its results into a readback buffer that
is then mapped, copies them out of it into a new array and unmaps it. Here the plan owns
page-aligned host memory in result blocks, each the memory of a buffer: ``out``, ``(m, l)`` and
the R6 error words in the layout of a device call's results (``CallResult``), written there by
the combine and the hand-over kernels themselves (no copy commands, no map or unmap). The call
waits for its submission, reads ``(m, l)`` and the error words, and returns ``out`` as an array
over the block itself (no copy): the block is lent to the caller and taken back when the last
array over it is gone (a finalizer on the array every view of it keeps alive). A plan lends at
most ``LEND`` blocks at a time; past that, a call uses the plan's own block and copies ``out``
out of it.

Measured on an H200 through Dawn (decode ``forward()``, 512 KiB in and out, with the polled
wait of ``_transfer.wait_queue_spinning``): the wait for the submission 198 -> 152 us, reading
the results 90 -> 41 us, the whole call 644 -> 501 us (``docs/benchmarks.md``, 2026-12-03).
The inputs (``q``, ``selected``) are not staged here: copied into such memory by numpy and from
there to the device by the layer's encoder, the GPU waited 17-19 us longer per call than for
the same bytes written by ``queue.write_buffer`` (Dawn's own staging memory), in every process
measured (``docs/benchmarks.md``, 2026-12-03 17:10 UTC), so a layer writes them.

The memory is only ever used by a call that waits for its submission before it returns (host
results), and the backend's lock serialises calls, so a call never writes results the GPU is
still using, and a lent block is never written while an array over it lives. Plans whose
result blocks exceed ``HOST_IO_BYTES`` do without (pinned memory per plan is kept small; a
prefill's copies are bound by the bus anyway).
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np

from ._runtime import gpu_error_types
from ._webgpu import BufferUsage

__all__ = ["HOST_IO_BYTES", "LEND", "HostIO", "host_io"]

HOST_IO_BYTES = 16 << 20  # every result block together, per plan
LEND = 4  # result blocks a plan lends out at a time (arrays the caller still holds)


class ResultBlock:
    """Host memory of one call's results and the buffer over it."""

    __slots__ = ("buffer", "bytes", "lent", "mem")

    def __init__(self, io: HostIO, lent: bool):
        mem = io.memory.allocate_host_memory(io.device, max(io.result_bytes, 16))
        self.buffer = io.memory.create_buffer_from_host_memory(
            io.device, mem, usage=BufferUsage.STORAGE | BufferUsage.COPY_DST, label="plan.host_results")
        io.owner.append(self.buffer)
        self.mem = mem
        self.bytes = np.frombuffer(mem, dtype=np.uint8)
        self.lent = lent


class HostIO:
    """Pinned result blocks of one plan (see the module docstring).

    Parameters
    ----------
    ctx : DeviceContext
        Its runtime maps host memory (``ctx.host_memory``).
    result_bytes : int
        Size of a result block (``CallResult.nbytes``).
    owner : list
        Where the buffers made go (the plan destroys them when it closes).
    """

    def __init__(self, ctx, result_bytes: int, owner: list):
        self.memory = ctx.runtime.host_memory_module()
        self.device = ctx.device
        self.owner = owner
        self.result_bytes = int(result_bytes)
        self.own = ResultBlock(self, lent=False)
        self._free: list[ResultBlock] = []  # lendable blocks no array refers to
        self._made = 0  # lendable blocks made

    def take(self) -> ResultBlock:
        """A block for a call's results: a free lendable one, a new one (up to ``LEND``), else
        the plan's own. A lendable block the call does not lend goes back with ``put``."""
        if self._free:
            return self._free.pop()
        if self._made < LEND:
            self._made += 1
            return ResultBlock(self, lent=True)
        return self.own

    def put(self, block: ResultBlock) -> None:
        """Take back a lendable block (no array refers to it)."""
        if block.lent:
            self._free.append(block)

    def out(self, block: ResultBlock, nbytes: int, shape: tuple) -> np.ndarray:
        """The float32 ``out`` at the start of ``block``: an array over the block, which comes
        back when no array refers to it any more; a copy from the plan's own block."""
        if not block.lent:
            return block.bytes[:nbytes].view(np.float32).reshape(shape).copy()
        # a new array over the memory (not a view of block.bytes): the array every view and
        # reshape of it refers to as its base, so that it dies with the last of them
        flat = np.frombuffer(block.mem, dtype=np.float32, count=nbytes // 4)
        weakref.finalize(flat, self._free.append, block)
        return flat.reshape(shape)


def host_io(ctx, result_bytes: int, owner: list) -> HostIO | None:
    """A plan's ``HostIO``, or None where the runtime cannot map host memory or the plan's
    result blocks exceed ``HOST_IO_BYTES``.

    A device that offers the feature but refuses the memory (a driver's limit on pinned memory,
    an alignment it reports wrongly) gives None with a ``RuntimeWarning`` that says why: the
    plan then reads its results back through a mapped buffer, the same results, as on a
    device without the feature (the transport changes, never the values)."""
    if not ctx.host_memory or (1 + LEND) * result_bytes > HOST_IO_BYTES:
        return None
    try:
        return HostIO(ctx, result_bytes, owner)
    except (*gpu_error_types(), ValueError, OSError) as exc:
        warnings.warn(f"paged_sparse_attn: the device offers buffers of host memory but refused them "
                      f"({type(exc).__name__}: {exc}); this plan reads its results back through a "
                      "mapped buffer instead", RuntimeWarning, stacklevel=2)
        return None
