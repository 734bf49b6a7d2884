"""Several planned layers in one command encoder, submitted together (R36).

A planned layer on device arrays (``AttentionPlan.run`` / ``run_sparse`` with device ``q``, and
device ``selected`` / ``index_q``) records its passes into the device's open :class:`Batch`
instead of an encoder and a submission of its own. The batch is finished and submitted when it
holds ``layers_per_submission`` layers, after its first layer when the device had nothing to do
(``ctx.queue_idle``: nothing submitted since a wait for the whole queue), and before anything
that must come after its work on the queue. That is kept in one place: the device the backend uses is a :class:`DeviceView`,
whose queue (:class:`FlushingQueue`) submits the open batch before any submission, buffer write
or read and wait of anyone; and a buffer is not destroyed while a batch is open (``retire``
holds it until the batch is submitted), since a recorded command may still use it.

Why: on the H200 a decode attention layer's host work for its own encoder, ``finish`` and
submission was what the pipelined loop waited for; four layers per encoder took Dawn's loop from
159 to 118 µs per layer, and with the error words handed over by a kernel instead of a clear and
a copy per layer (``psa_handoff.wgsl``) to 98 µs (``scripts/experiment_defer_layers.py``). A
batch whose device is idle goes at once: a loop of prefill layers (each ~5 ms of GPU work and
~0.7 ms of host work) otherwise left the GPU waiting for the host to record four layers after
every synchronisation.

Nothing recorded is lost silently: if recording a layer fails part-way (or the batch's
submission fails), the batch is dropped and every call whose work it held raises
``DeviceError`` when its results are read (:attr:`Batch.failed`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

from ._record import finish_and_submit, new_encoder, recorder

__all__ = ["Batch", "DeviceView", "FlushingQueue", "drop", "flush", "open_batch", "retire"]

# buffers whose destruction waits for the open batches (finalizers run at any time; a command a
# batch recorded may still use them); destroyed when no batch is open any more
_held: list = []
# the device contexts with a batch recorded and not yet submitted (weakly: a context dropped with
# its batch open, by a backend nobody closed, must not hold every later destruction back)
_open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(ctx) -> ctx
# guards the two above: backends of different devices (each with its lock) may open, submit and
# retire at once, and finalizers run in any thread (re-entrant: one may run inside these functions)
_state = threading.RLock()


class Batch:
    """The open command encoder of a device and how many layers it holds; ``failed``: the
    exception that dropped it (its layers' results raise when read), else None; ``recording``:
    a layer is being recorded into it (no queue operation may come in between)."""

    __slots__ = ("encoder", "failed", "layers", "recording")

    def __init__(self, encoder: Any):
        self.encoder = encoder
        self.layers = 0
        self.failed: BaseException | None = None
        self.recording = False


class FlushingQueue:
    """A device queue that submits the device's open batch before anything that must follow it."""

    __slots__ = ("_ctx", "_queue")

    def __init__(self, queue: Any, ctx: Any):
        self._queue = queue
        self._ctx = ctx

    def submit(self, command_buffers) -> None:
        flush(self._ctx)
        self._ctx.queue_idle = False
        self._queue.submit(command_buffers)

    def submit_encoder(self, encoder, rec=None) -> None:
        """Finish ``encoder`` and submit it (through ``rec``, a ``_record.Recorder``, where
        given: ``_record.finish_and_submit``)."""
        flush(self._ctx)
        self._ctx.queue_idle = False
        finish_and_submit(rec, self._queue, encoder)

    def write_buffer(self, *args, **kwargs) -> None:
        flush(self._ctx)
        self._queue.write_buffer(*args, **kwargs)

    def read_buffer(self, *args, **kwargs):
        flush(self._ctx)
        return self._queue.read_buffer(*args, **kwargs)

    def on_submitted_work_done_sync(self) -> None:
        flush(self._ctx)
        self._queue.on_submitted_work_done_sync()

    def on_submitted_work_done_async(self):
        flush(self._ctx)
        return self._queue.on_submitted_work_done_async()

    def flushed(self) -> Any:
        """The runtime's queue itself, the open batch submitted first (Dawn's polled wait,
        ``_runtime._dawn_poll_work_done``, calls it directly: the batch's work included)."""
        flush(self._ctx)
        return self._queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


class DeviceView:
    """The device as the backend uses it: every attribute the device's own, but ``queue`` a
    :class:`FlushingQueue` (``raw`` is the device itself)."""

    __slots__ = ("queue", "raw")

    def __init__(self, device: Any, ctx: Any):
        self.raw = device
        self.queue = FlushingQueue(device.queue, ctx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def open_batch(ctx: Any) -> Batch:
    """The device's open batch (a new encoder when there is none)."""
    b = ctx.batch
    if b is None:
        b = Batch(new_encoder(recorder(ctx.runtime), ctx.device.raw))  # (the runtime's checked C calls)
        with _state:
            ctx.batch = b
            _open[id(ctx)] = ctx
    return b


def _close(ctx: Any) -> Batch | None:
    with _state:
        b, ctx.batch = ctx.batch, None
        _open.pop(id(ctx), None)
    return b


def flush(ctx: Any) -> None:
    """Finish and submit the device's open batch, if any (then destroy the buffers held for it)."""
    if ctx.batch is None:
        return  # (every write, submission and wait of the queue comes through here: nothing to do)
    if ctx.batch.recording:
        raise RuntimeError("paged_sparse_attn internal error: the device's queue was used while a layer was "
                           "recorded into the open batch (R36)")
    b = _close(ctx)
    if b is not None:
        try:
            ctx.queue_idle = False
            finish_and_submit(recorder(ctx.runtime), ctx.device.raw.queue, b.encoder)
        except BaseException as exc:
            b.failed = exc
            raise
        finally:
            b.encoder = None
            _release_held()


def drop(ctx: Any, exc: BaseException) -> None:
    """Discard the device's open batch after ``exc``: the calls it held raise when read."""
    b = _close(ctx)
    if b is not None:
        b.failed = exc
        b.encoder = None
        _release_held()


def retire(buffers) -> bool:
    """Hold ``buffers`` for destruction after the open batches are submitted; False (nothing
    held) when no batch is open."""
    with _state:
        if len(_open):
            _held.extend(buffers)
            return True
    _release_held()  # (what an open batch of a context since collected still held)
    return False


def _release_held() -> None:
    with _state:
        if len(_open):
            return
        doomed = list(_held)
        _held.clear()
    for b in doomed:
        with contextlib.suppress(Exception):  # (a buffer of a device since destroyed)
            b.destroy()
