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
most ``LEND`` blocks at a time (two, for plans whose blocks are large: below); past that, a
call uses the plan's own block and copies ``out`` out of it.

Measured on an H200 through Dawn (decode ``forward()``, 512 KiB in and out, with the polled
wait of ``_transfer.wait_queue_spinning``): the wait for the submission 198 -> 152 us, reading
the results 90 -> 41 us, the whole call 644 -> 501 us (``docs/benchmarks.md``, 2026-12-03).
Inputs: a decode call's ``q`` and ``selected`` are not staged here: copied into such memory by
numpy and from there to the device by the layer's encoder, the GPU waited 17-19 us longer per
call than for the same bytes written by ``queue.write_buffer`` (Dawn's own staging memory), in
every process measured (``docs/benchmarks.md``, 2026-12-03 17:10 UTC), so a layer writes them.
A host ``q`` of ``INPUT_MIN_BYTES`` or more (a prefill's: 64 MiB for the bench's 4096 queries;
float32, or float16 before the device widens it) is: Dawn's write of 64 MiB took 21 ms on the
H200, numpy's copy of it 10 ms (``scripts/experiment_large_writes.py``, 2026-12-04). A call
with a host ``q`` always waits for its submission (its results are host arrays), so the plan's
one input block is free again when the next call writes it. A copy that large is split among
threads (``copy_in``): one thread took 13.2 ms for 64 MiB, four 4.9.

The index branch's calls with host arrays take the same way for their large inputs (``index_q``,
the scores given to ``select_topk``: ``call_input``, one block per input kept on the device
context): Dawn's ``write_buffer`` of a prefill's 8 + 16 MiB took ~11 ms of the two calls' 18.8 on
the H200, 10.4 ms in all through pinned memory (``docs/benchmarks.md``, 2026-12-04 09:19).

The memory is only ever used by a call that waits for its submission before it returns (host
results), and the backend's lock serialises calls, so a call never writes results the GPU is
still using, and a lent block is never written while an array over it lives.

Pinned memory per plan is bounded: a plan lends ``LEND`` blocks where its own block and those
take at most ``HOST_IO_BYTES`` together (decode: 512 KiB blocks), else two, where a block
takes at most ``HOST_IO_MAX_BLOCK`` (prefill: the bench's 4096 queries make 64 MiB blocks).
Two, because a loop ``out = forward(...)`` still holds the last call's ``out`` while the next
call runs: with one, every other call would copy its results out of the plan's own block. A
plan makes one lendable block with its HostIO, the others and its own block when a call first
needs them (a loop that drops each ``out`` before its next call but one never needs the own
block: 128 MiB of pinned memory for the bench's prefill plan). On the H200 through Dawn a
64 MiB result read back through a mapped buffer took 22 ms (a copy into the buffer, the map,
the bytes copied out), the host's own copy of 64 MiB 10 ms
(``scripts/experiment_large_writes.py``, 2026-12-04): a lent block copies nothing.

Pinned memory per backend is bounded too: the blocks of all its plans (a plan cache keeps up to
eight) count against its ``max_host_bytes`` (``PinnedAccount``, default ``MAX_HOST_BYTES``,
1 GiB), each from when it is made until it is collected (a plan drops its blocks when it closes;
a lent block lives while an array over it does). A block with no room is not made: a call then
uses another free block or the plan's own, else reads its results back through a mapped buffer;
a large ``q`` is written with ``write_buffer``. The transport changes, never the values.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._runtime import gpu_error_types
from ._webgpu import BufferUsage

__all__ = ["HOST_IO_BYTES", "HOST_IO_MAX_BLOCK", "INPUT_MIN_BYTES", "LEND", "MAX_HOST_BYTES", "HostIO", "InputBlock",
           "OverBudget", "PinnedAccount", "call_input", "host_input", "host_io", "lendable"]

HOST_IO_BYTES = 16 << 20  # a plan's own block and LEND lendable ones together, at most
HOST_IO_MAX_BLOCK = 128 << 20  # the largest result block a plan keeps in host memory (lending two)
LEND = 4  # result blocks a plan lends out at a time (arrays the caller still holds)
INPUT_MIN_BYTES = 8 << 20  # a host q this large goes through the plan's pinned memory (above)
# pinned memory a backend's plans hold together, at most, by default (``max_host_bytes``): eight
# cached prefill plans of the bench's shape could otherwise pin 2 GiB of the host's memory
MAX_HOST_BYTES = 1 << 30
PAGE = 4096
COPY_MIN_BYTES = 16 << 20  # a host copy this large into pinned memory goes in slices, by threads
COPY_THREADS = 4  # (the H200's host: 4 threads 4.9 ms for 64 MiB, 8 threads 5.4, one 13.2)


class OverBudget(Exception):
    """A pinned block the backend's ``max_host_bytes`` leaves no room for (not an error: the
    plan takes its other transport)."""


class PinnedAccount:
    """The pinned host memory a backend's plans hold (``used``, bytes) against its limit
    (``limit``, ``max_host_bytes``). A block reserves its pages before its memory is made and
    gives them back when it is collected (the plan drops its blocks when it closes; a lent block
    lives as long as an array over it)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` in; ``OverBudget`` (nothing counted) where they exceed the limit."""
        with self._lock:
            if self.used + nbytes > self.limit:
                raise OverBudget(f"{nbytes} bytes of pinned memory would exceed max_host_bytes={self.limit} "
                                 f"({self.used} held)")
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


def lendable(result_bytes: int) -> int:
    """Blocks a plan with result blocks of ``result_bytes`` lends at a time: ``LEND`` where they
    and the plan's own fit ``HOST_IO_BYTES``, else 2 up to ``HOST_IO_MAX_BLOCK``, else 0 (the
    plan keeps no results in host memory)."""
    if (1 + LEND) * result_bytes <= HOST_IO_BYTES:
        return LEND
    return 2 if result_bytes <= HOST_IO_MAX_BLOCK else 0


class _Pinned:
    """Page-aligned host memory of ``nbytes`` (``mem``, and ``bytes`` over it) and the buffer the
    device makes of it (``buffer``, appended to ``owner``, which the plan destroys), counted in
    ``account`` while the block lives (``OverBudget`` where it has no room: nothing is made)."""

    __slots__ = ("__weakref__", "buffer", "bytes", "mem")

    def __init__(self, memory, device, nbytes: int, usage: int, label: str, owner: list, account: PinnedAccount):
        pages = -(-max(nbytes, 16) // PAGE) * PAGE
        account.reserve(pages)
        try:
            self.mem = memory.allocate_host_memory(device, max(nbytes, 16))
            self.buffer = memory.create_buffer_from_host_memory(device, self.mem, usage=usage, label=label)
        except BaseException:
            account.release(pages)
            raise
        weakref.finalize(self, account.release, pages)
        owner.append(self.buffer)
        self.bytes = np.frombuffer(self.mem, dtype=np.uint8)


class ResultBlock(_Pinned):
    """Host memory of one call's results and the buffer over it."""

    __slots__ = ("lent",)

    def __init__(self, io: HostIO, lent: bool):
        super().__init__(io.memory, io.device, io.result_bytes, BufferUsage.STORAGE | BufferUsage.COPY_DST,
                         "plan.host_results", io.owner, io.account)
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
    account : PinnedAccount
        The backend's pinned memory, which every block is counted in: the first lendable block
        (made here) raises ``OverBudget`` where it has no room; a later block that has none is
        not made (``take``).
    """

    def __init__(self, ctx, result_bytes: int, owner: list, account: PinnedAccount):
        self.memory = ctx.runtime.host_memory_module()
        self.device = ctx.device
        self.owner = owner
        self.account = account
        self.result_bytes = int(result_bytes)
        self.lend = lendable(self.result_bytes)
        self._own: ResultBlock | None = None
        # the first lendable block now: memory the device refuses is found here, not mid-call
        self._free: list[ResultBlock] = [ResultBlock(self, lent=True)]  # lendable, no array refers to
        self._made = 1  # lendable blocks made

    @property
    def own(self) -> ResultBlock:
        """The plan's own block (made when first used): results copied out of it."""
        if self._own is None:
            self._own = ResultBlock(self, lent=False)
        return self._own

    def take(self) -> ResultBlock | None:
        """A block for a call's results: a free lendable one, a new one (up to ``self.lend``),
        else the plan's own; None where the one it would make has no room in the backend's
        pinned memory (the call then reads its results back through a mapped buffer). A
        lendable block the call does not lend goes back with ``put``."""
        if self._free:
            return self._free.pop()
        try:
            if self._made < self.lend:
                blk = ResultBlock(self, lent=True)
                self._made += 1
                return blk
            return self.own
        except OverBudget:
            return None

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
        # (through a weak reference: a plan that dropped its HostIO does not keep its free
        # blocks, and their pinned memory, alive for as long as an array over a lent one lives)
        weakref.finalize(flat, _give_back, weakref.ref(self), block)
        return flat.reshape(shape)


def _give_back(io_ref, block: ResultBlock) -> None:
    """A lent block whose last array is gone: free again in its HostIO, if that still lives."""
    io = io_ref()
    if io is not None:
        io._free.append(block)


class InputBlock(_Pinned):
    """Pinned host memory of a plan's host ``q`` (see the module docstring): numpy copies the
    array in, the layer's encoder copies it to the device.

    Parameters
    ----------
    ctx : DeviceContext
        Its runtime maps host memory (``ctx.host_memory``).
    nbytes : int
        Size of the input (float32 ``q`` [Tq, Hq, D]: ``4 Tq Hq D``).
    owner : list
        Where the buffer goes (the plan destroys it when it closes).
    account : PinnedAccount
        The backend's pinned memory (``OverBudget`` where it has no room).
    """

    __slots__ = ()

    def __init__(self, ctx, nbytes: int, owner: list, account: PinnedAccount, label: str = "plan.host_q"):
        super().__init__(ctx.runtime.host_memory_module(), ctx.device, nbytes, BufferUsage.COPY_SRC, label,
                         owner, account)

    def write(self, arr: np.ndarray) -> None:
        """Copy the C-contiguous ``arr`` to the start of the block (``copy_in``)."""
        copy_in(self.bytes[:arr.nbytes], arr.reshape(-1).view(np.uint8))


_copiers: list = []  # the thread pool of copy_in, made at its first large copy
_copiers_lock = threading.Lock()


def copy_in(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` (uint8, same size); one of ``COPY_MIN_BYTES`` or more in page-aligned
    slices copied by up to ``COPY_THREADS`` threads at once (numpy releases the GIL while it
    copies). On the H200's host a 64 MiB copy into a plan's pinned memory took 13.2 ms in one
    thread and 4.9 in four (``scripts/experiment_large_writes.py``, 2026-12-04): one thread does
    not reach the memory's bandwidth."""
    n = src.nbytes
    threads = min(COPY_THREADS, os.cpu_count() or 1)
    if n < COPY_MIN_BYTES or threads < 2:
        dst[:] = src
        return
    with _copiers_lock:
        if not _copiers:
            _copiers.append(ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="paged_sparse_attn.copy"))
    step = -(-n // threads // PAGE) * PAGE
    futures = [_copiers[0].submit(np.copyto, dst[i:i + step], src[i:i + step]) for i in range(0, n, step)]
    for f in futures:
        f.result()  # (every slice done, or its error raised, before the encoder copies the block)


def host_input(ctx, nbytes: int, owner: list, account: PinnedAccount, label: str = "plan.host_q",
               instead: str = "this plan writes its queries with write_buffer") -> InputBlock | None:
    """A plan's ``InputBlock`` for a host ``q`` of ``nbytes``, or None where the runtime cannot
    map host memory, the input is below ``INPUT_MIN_BYTES`` or above ``HOST_IO_MAX_BLOCK``, the
    backend's pinned memory (``account``) has no room for it, or the device refuses the memory
    (then with a ``RuntimeWarning`` saying why; the layer writes ``q`` with ``write_buffer``
    instead: the transport changes, never the values)."""
    if not ctx.host_memory or not INPUT_MIN_BYTES <= nbytes <= HOST_IO_MAX_BLOCK:
        return None
    return _made_or_warned(lambda: InputBlock(ctx, nbytes, owner, account, label), instead)


def call_input(ctx, key: tuple, nbytes: int, account: PinnedAccount) -> InputBlock | None:
    """The device's ``InputBlock`` for a large host input of a call that waits for its
    submission (the index branch's ``index_q`` and scores), kept in ``ctx.host_inputs`` under
    ``key`` (its label and slot) and reused by the next such call, made anew (the old one's
    buffer destroyed) when it is too small; None where ``host_input`` gives none: the call then
    writes the array with ``write_buffer``. A call waits for its submission before it returns,
    so the next call's write into the block finds the copy out of it done."""
    have = ctx.host_inputs.get(key)
    if have is not None and nbytes <= have.bytes.nbytes:
        return have
    if have is not None:
        del ctx.host_inputs[key]
        have.buffer.destroy()
    # (its buffer goes with the device, or is destroyed above when a larger one replaces it)
    blk = host_input(ctx, nbytes, [], account, f"{key[0]}.pinned", f"the call writes its {key[0]} with write_buffer")
    if blk is not None:
        ctx.host_inputs[key] = blk
    return blk


def host_io(ctx, result_bytes: int, owner: list, account: PinnedAccount) -> HostIO | None:
    """A plan's ``HostIO``, or None where the runtime cannot map host memory, the plan's result
    blocks exceed ``HOST_IO_MAX_BLOCK`` or the backend's pinned memory (``account``) has no room
    for the first of them.

    A device that offers the feature but refuses the memory (a driver's limit on pinned memory,
    an alignment it reports wrongly) gives None with a ``RuntimeWarning`` that says why: the
    plan then reads its results back through a mapped buffer, the same results, as on a
    device without the feature (the transport changes, never the values)."""
    if not ctx.host_memory or not lendable(result_bytes):
        return None
    return _made_or_warned(lambda: HostIO(ctx, result_bytes, owner, account),
                           "this plan reads its results back through a mapped buffer")


def _made_or_warned(make, instead: str):
    """``make()``, or None with a ``RuntimeWarning`` naming the runtime's reason where the device
    refuses host memory it offers; ``instead`` says what the caller does then (the transport
    changes, never the values)."""
    try:
        return make()
    except OverBudget:
        return None  # (the limit the backend was given: no warning)
    except (*gpu_error_types(), ValueError, OSError) as exc:
        warnings.warn(f"paged_sparse_attn: the device offers buffers of host memory but refused them "
                      f"({type(exc).__name__}: {exc}); {instead} instead", RuntimeWarning,
                      stacklevel=3)
        return None
