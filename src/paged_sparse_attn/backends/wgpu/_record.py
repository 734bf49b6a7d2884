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
still goes through wgpu-py, which raises (``tests/test_wgpu_record.py`` checks this on both
runtimes, Dawn through its Null adapter). The pipelines and bind groups a plan records are its
own and cached, so their handles outlive the encoder.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ._runtime import Runtime

__all__ = ["Pass", "Recorder", "recorder"]


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

    def begin(self, encoder: Any) -> Pass:
        """An untimed compute pass of ``encoder`` (a wgpu-py command encoder); end it with
        ``Pass.end``. Errors of what it records are reported when the encoder finishes."""
        return Pass(self.begin_pass(encoder._internal, self.pass_desc), self.end_pass, self.release_pass)

    def dispatch3(self, cp: Any, pipeline: Any, bind_group: Any, x: int, y: int) -> None:
        """Record, in compute pass ``cp``: ``pipeline``, ``bind_group`` at index 0 (no dynamic
        offsets), a dispatch of ``x`` by ``y`` workgroups (wgpu-py objects)."""
        h = cp._internal
        self.set_pipeline(h, pipeline._internal)
        self.set_bind_group(h, 0, bind_group._internal, 0, self.null)
        self.dispatch(h, x, y, 1)


def recorder(runtime: Runtime) -> Recorder | None:
    """The runtime's dispatch functions, or None when it names no C module (wgpu-py's calls
    are then used)."""
    if not runtime.c_module:
        return None
    mod = importlib.import_module(runtime.c_module)
    lib, ffi = mod.lib, mod.ffi
    desc = ffi.new("WGPUComputePassDescriptor *")  # zeroed: no chain, an empty label, no timestamps
    return Recorder(lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                    lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL, lib.wgpuCommandEncoderBeginComputePass,
                    lib.wgpuComputePassEncoderEnd, lib.wgpuComputePassEncoderRelease, desc)
