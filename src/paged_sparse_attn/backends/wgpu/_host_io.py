"""Host memory the GPU reads and writes itself: a plan's inputs and results for calls with host
arrays, on runtimes that map host memory into buffers (Dawn's ``host-mapped-pointer``).

A ``forward()`` call with host arrays otherwise writes its queries and selection with
``queue.write_buffer`` (the runtime copies them into staging memory of its own, then to the
device), copies its results into a readback buffer that is then mapped, copies them out of it
into a new array and unmaps it. Here the plan owns page-aligned host memory, each block the
memory of a buffer:

- ``inputs``: the layer's tensors are copied into it by numpy (one copy, as ``write_buffer``
  makes), then copied to the plan's device buffers by the layer's command encoder;
- result blocks: ``out``, ``(m, l)`` and the R6 error words in the layout of a device call's
  results (``CallResult``), written there by the combine and the hand-over kernels themselves
  (no copy commands, no map or unmap). The call waits for its submission, reads ``(m, l)`` and
  the error words, and returns ``out`` as an array over the block itself (no copy): the block is
  lent to the caller and taken back when the last array over it is gone (a finalizer on the
  array every view of it keeps alive). A plan lends at most ``LEND`` blocks at a time; past
  that, a call uses the plan's own block and copies ``out`` out of it.

Measured on an H200 through Dawn (decode ``forward()``, 512 KiB in and out, with the polled
wait of ``_transfer.wait_queue_spinning``): the wait for the submission 198 -> 152 us, reading
the results 90 -> 41 us, the whole call 644 -> 501 us (``docs/benchmarks.md``, 2026-12-03). The memory is only ever used by a call that waits for its submission before it
returns (host results), and the backend's lock serialises calls, so a call never writes inputs
or results the GPU is still using, and a lent block is never written while an array over it
lives. Plans whose inputs and results exceed ``HOST_IO_BYTES`` do without (pinned memory per
plan is kept small; a prefill's copies are bound by the bus anyway).
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np

from ._runtime import gpu_error_types
from ._webgpu import BufferUsage

__all__ = ["HOST_IO_BYTES", "LEND", "HostIO", "host_io"]

HOST_IO_BYTES = 16 << 20  # inputs and every result block together, per plan
LEND = 4  # result blocks a plan lends out at a time (arrays the caller still holds)
_ALIGN = 256  # offsets of the tensors in the inputs block (copy offsets need 4; storage 256)


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
    """Pinned inputs and result blocks of one plan (see the module docstring).

    Parameters
    ----------
    ctx : DeviceContext
        Its runtime maps host memory (``ctx.host_memory``).
    inputs : dict
        ``{role: nbytes}`` of the layer's host tensors copied through the inputs block.
    result_bytes : int
        Size of a result block (``CallResult.nbytes``).
    owner : list
        Where the buffers made go (the plan destroys them when it closes).
    """

    def __init__(self, ctx, inputs: dict[str, int], result_bytes: int, owner: list):
        self.memory = ctx.runtime.host_memory_module()
        self.device = ctx.device
        self.owner = owner
        self.result_bytes = int(result_bytes)
        self.at: dict[str, int] = {}
        at = 0
        for role, n in inputs.items():
            self.at[role] = at
            at += int(n) + (-int(n)) % _ALIGN
        mem = self.memory.allocate_host_memory(self.device, max(at, 16))
        self.inputs = self.memory.create_buffer_from_host_memory(self.device, mem, usage=BufferUsage.COPY_SRC,
                                                                 label="plan.host_inputs")
        owner.append(self.inputs)
        self.in_bytes = np.frombuffer(mem, dtype=np.uint8)
        self.own = ResultBlock(self, lent=False)
        self._free: list[ResultBlock] = []  # lendable blocks no array refers to
        self._made = 0  # lendable blocks made

    def stage(self, enc, role: str, src: np.ndarray, dst, nbytes: int) -> bool:
        """Copy host array ``src`` into the inputs block and record its copy into buffer ``dst``;
        False (nothing done) when ``src`` is not a C-contiguous array of ``nbytes`` bytes."""
        if not (isinstance(src, np.ndarray) and src.flags.c_contiguous and src.nbytes == nbytes):
            return False
        at = self.at[role]
        np.copyto(self.in_bytes[at:at + nbytes], src.reshape(-1).view(np.uint8))
        enc.copy_buffer_to_buffer(self.inputs, at, dst, 0, nbytes)
        return True

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


def host_io(ctx, inputs: dict[str, int], result_bytes: int, owner: list) -> HostIO | None:
    """A plan's ``HostIO``, or None where the runtime cannot map host memory or the plan's
    inputs and result blocks exceed ``HOST_IO_BYTES``.

    A device that offers the feature but refuses the memory (a driver's limit on pinned memory,
    an alignment it reports wrongly) gives None with a ``RuntimeWarning`` that says why: the
    plan then moves host arrays by writes and a mapped readback, the same results, as on a
    device without the feature (the transport changes, never the values)."""
    if not ctx.host_memory or sum(inputs.values()) + (1 + LEND) * result_bytes > HOST_IO_BYTES:
        return None
    try:
        return HostIO(ctx, inputs, result_bytes, owner)
    except (*gpu_error_types(), ValueError, OSError) as exc:
        warnings.warn(f"paged_sparse_attn: the device offers buffers of host memory but refused them "
                      f"({type(exc).__name__}: {exc}); this plan moves host arrays by writes and a mapped "
                      "readback instead", RuntimeWarning, stacklevel=2)
        return None
