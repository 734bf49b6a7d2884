"""A planned layer's dispatches recorded through the runtime's C functions, not wgpu-py's wrappers.

wgpu-py calls each C function of wgpu-native through an error-capturing proxy (an ``ErrorSlot``
and two deque operations per call, so that an error the call reports is raised by it). A decode
layer records three dispatches of three calls each per layer, and the plan's loop is bound by
the host on wgpu-native (118 µs of calls per layer on the H200 against 99 µs of GPU work), so
the planned layer records its dispatches (pipeline, bind group, grid) straight through the C
functions of both runtimes.

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

__all__ = ["Recorder", "recorder"]


@dataclass(frozen=True)
class Recorder:
    """The three C functions of a dispatch, and the NULL of the runtime's cffi."""

    set_pipeline: Any
    set_bind_group: Any
    dispatch: Any
    null: Any

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
    return Recorder(lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                    lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL)
