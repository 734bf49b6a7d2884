"""A planned layer's dispatches recorded through the runtime's C functions, not wgpu-py's wrappers.

wgpu-py calls each C function of wgpu-native through an error-capturing proxy (an ``ErrorSlot``
and two deque operations per call, so that an error the call reports is raised by it). A decode
layer records three dispatches of three calls each per layer, and the plan's loop is bound by
the host on wgpu-native (118 µs of calls per layer on the H200 against 99 µs of GPU work), so
the planned layer records its dispatches (pipeline, bind group, grid) straight through the C
functions of both runtimes, and a decode layer's untimed pass is begun and ended there too
(wgpu-py's ``begin_compute_pass`` builds its descriptor, label and pass object per call: 13 µs
of a decode ``forward()`` on the H200 through Dawn, 2026-12-03).

Nothing is lost by it: a compute pass's commands are validated when the command encoder
finishes (wgpu-native reports a dispatch with an incompatible bind group from
``wgpuCommandEncoderFinish``; Dawn holds an encoder's errors until ``Finish``), and ``finish``
goes through wgpu-py's checked call of it, which raises (``tests/test_wgpu_record.py`` checks
this on both runtimes, Dawn through its Null adapter). The pipelines and bind groups a plan
records are its own and cached, so their handles outlive the encoder.

A planned layer's encoder is made, finished and submitted through those checked calls too
(``Recorder.encoder`` and ``Recorder.submit``: wgpu-py's ``libf``, each call of which raises the
error the runtime reports during it, as wgpu-py's methods do), with descriptors made once:
wgpu-py's methods build a descriptor, a label and a Python object per call (its encoder, finish
and submission took 20.6 µs per call against 6.1 this way on Dawn's Null adapter; on the H200 a
decode ``forward()`` 556 against 598 µs in one process, ``docs/benchmarks.md``, 2026-12-04).
The encoder is still wgpu-py's object (its methods, and its release when it is collected); the
command buffer is released as soon as it is submitted.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ._runtime import Runtime

__all__ = ["Pass", "Recorder", "finish_and_submit", "new_encoder", "recorder"]


class Pass:
    """An untimed compute pass begun through the C functions (``Recorder.begin``): what the
    recorder's dispatches use of a pass (``_internal``), and ``end``, which ends and releases it."""

    __slots__ = ("_end", "_internal", "_release")

    def __init__(self, handle: Any, end: Any, release: Any):
        self._internal = handle
        self._end = end
        self._release = release

    def end(self) -> None:
        h, self._internal = self._internal, None
        if h is not None:
            try:
                self._end(h)
            finally:
                self._release(h)

    def __del__(self) -> None:  # a pass left open by an error: its handle is still released
        h, self._internal = self._internal, None
        if h is not None:
            self._release(h)


@dataclass(frozen=True)
class Recorder:
    """The C functions of a dispatch and of an untimed pass, the NULL of the runtime's cffi, and
    the pass descriptor (no label, no timestamps), made once."""

    set_pipeline: Any
    set_bind_group: Any
    dispatch: Any
    null: Any
    begin_pass: Any = None
    end_pass: Any = None
    release_pass: Any = None
    pass_desc: Any = None
    # a layer's encoder, finish and submission (None where the runtime names no api_module)
    encoder_class: Any = None
    create_encoder: Any = None
    finish: Any = None
    submit_buffers: Any = None
    release_buffer: Any = None
    new: Any = None
    descs: Any = field(default=None, repr=False)  # (encoder descriptor, command buffer descriptor, label)

    def begin(self, encoder: Any) -> Pass:
        """An untimed compute pass of ``encoder`` (a wgpu-py command encoder); end it with
        ``Pass.end``. Errors of what it records are reported when the encoder finishes."""
        return Pass(self.begin_pass(encoder._internal, self.pass_desc), self.end_pass, self.release_pass)

    @property
    def encodes(self) -> bool:
        """Whether ``encoder`` and ``submit`` go through the checked C calls."""
        return self.create_encoder is not None

    def encoder(self, device: Any) -> Any:
        """A command encoder of ``device`` (wgpu-py's device object), labelled
        ``paged_sparse_attn.layer``: wgpu-py's encoder object over a handle made through the
        checked C call."""
        return self.encoder_class(LABEL, self.create_encoder(device._internal, self.descs[0]), device)

    def submit(self, queue: Any, encoder: Any) -> None:
        """Finish ``encoder`` and submit its command buffer to ``queue`` (wgpu-py's objects)
        through the checked C calls: what the runtime reports in either raises, as wgpu-py's
        ``finish`` and ``submit`` do. The command buffer is released once submitted (a finish
        that raises leaves the runtime's error object to the runtime)."""
        cb = self.finish(encoder._internal, self.descs[1])
        try:
            self.submit_buffers(queue._internal, 1, self.new("WGPUCommandBuffer[1]", [cb]))
        finally:
            self.release_buffer(cb)

    def dispatch3(self, cp: Any, pipeline: Any, bind_group: Any, x: int, y: int) -> None:
        """Record, in compute pass ``cp``: ``pipeline``, ``bind_group`` at index 0 (no dynamic
        offsets), a dispatch of ``x`` by ``y`` workgroups (wgpu-py objects)."""
        h = cp._internal
        self.set_pipeline(h, pipeline._internal)
        self.set_bind_group(h, 0, bind_group._internal, 0, self.null)
        self.dispatch(h, x, y, 1)


LABEL = "paged_sparse_attn.layer"


def new_encoder(rec: Recorder | None, device: Any) -> Any:
    """A command encoder of ``device`` (wgpu-py's device object): through ``rec``'s checked C
    calls where it encodes, else wgpu-py's ``create_command_encoder`` (same label)."""
    if rec is not None and rec.encodes:
        return rec.encoder(device)
    return device.create_command_encoder(label=LABEL)


def finish_and_submit(rec: Recorder | None, queue: Any, encoder: Any) -> None:
    """Finish ``encoder`` and submit it to ``queue`` (wgpu-py's queue object): through ``rec``'s
    checked C calls where it encodes, else wgpu-py's ``finish`` and ``submit``."""
    if rec is not None and rec.encodes:
        rec.submit(queue, encoder)
    else:
        queue.submit([encoder.finish()])


_recorders: dict[str, Recorder] = {}  # per runtime name: its C functions and descriptors, made once


def recorder(runtime: Runtime) -> Recorder | None:
    """The runtime's dispatch functions (and, where it names its api module, its encoder's),
    made once per runtime; None when it names no C module (wgpu-py's calls are then used)."""
    if not runtime.c_module:
        return None
    rec = _recorders.get(runtime.name)
    if rec is not None:
        return rec
    mod = importlib.import_module(runtime.c_module)
    lib, ffi = mod.lib, mod.ffi
    desc = ffi.new("WGPUComputePassDescriptor *")  # zeroed: no chain, an empty label, no timestamps
    enc: dict = {}
    if runtime.api_module:
        api = importlib.import_module(runtime.api_module)
        label = ffi.new("char[]", LABEL.encode())
        edesc = ffi.new("WGPUCommandEncoderDescriptor *")
        edesc.label.data, edesc.label.length = label, len(LABEL)
        enc = {"encoder_class": api.GPUCommandEncoder, "create_encoder": api.libf.wgpuDeviceCreateCommandEncoder,
               "finish": api.libf.wgpuCommandEncoderFinish, "submit_buffers": api.libf.wgpuQueueSubmit,
               "release_buffer": lib.wgpuCommandBufferRelease, "new": ffi.new,
               "descs": (edesc, ffi.new("WGPUCommandBufferDescriptor *"), label)}
    rec = _recorders[runtime.name] = Recorder(
        lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
        lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL, lib.wgpuCommandEncoderBeginComputePass,
        lib.wgpuComputePassEncoderEnd, lib.wgpuComputePassEncoderRelease, desc, **enc)
    return rec
