"""The WebGPU runtimes the WGSL backend runs on: wgpu-native (``wgpu``) and Dawn (``dawn``).

Both are driven through the same Python API (wgpu-py's; ``wgpudawn`` implements it on Google's
Dawn), so the backend's host code and its WGSL are shared. What differs is data, kept here in
one record per runtime: the Python module, the pip extra, feature names, the WGSL directives a
shader compiler wants, whether shader modules can be created without runtime checks, the
instance and device toggles, and how to read the subgroup-matrix configurations.

Nothing here imports a runtime at module import; :meth:`Runtime.gpu` does, when a backend is
probed or opened.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["DAWN", "SUBGROUP", "SUBGROUP_MATRIX", "WGPU_NATIVE", "Runtime", "gpu_error_types"]

# Logical feature names used by the host code (``DeviceContext.features``) for features the
# runtimes spell differently.
SUBGROUP = "subgroup"
SUBGROUP_MATRIX = "subgroup-matrix"


@dataclass(frozen=True)
class Runtime:
    """What one WebGPU implementation needs from the host code (data, not try/except)."""

    name: str                       # backend name in the registry
    module: str                     # Python module with the wgpu-py API
    extra: str                      # pip extra that installs it
    subgroup_feature: str           # the runtime's name of the subgroup feature
    subgroup_directive: str         # WGSL directive a shader using subgroup builtins needs ("" if none)
    trusted_modules: bool           # shader modules can be created without runtime checks
    sgmat_feature: str | None       # subgroup-matrix feature, or None where the runtime has none
    # queue.on_submitted_work_done_sync() waits for the queue (Dawn, 22 us idle on an H200);
    # wgpu-py's binding of it fails against the wgpu-native it ships with, so that runtime waits
    # by mapping a 4-byte copy submitted after the work (R35)
    work_done_wait: bool = False
    # the cffi module (``lib``, ``ffi``) whose C functions a planned layer records its dispatches
    # with (_record.py); "" = through wgpu-py's wrappers
    c_module: str = ""
    # wgpu-py's module of the runtime's classes and checked C calls (``libf``: each raises the
    # error the runtime reports during it), with which a planned layer makes its encoder and
    # finishes and submits it (_record.py); "" = through wgpu-py's methods
    api_module: str = ""
    instance_toggles: tuple[str, ...] = ()
    device_toggles: tuple[str, ...] = ()
    driver_hint: str = ""
    # the feature that makes buffers of host memory (plans' pinned results, _host_io.py),
    # and the module of the runtime that makes them; None where the runtime has none
    host_memory_feature: str | None = None
    host_memory_extras: str = ""
    # poll_work_done(device, spin_s): wait for the queue's submitted work, polling without
    # blocking for up to spin_s seconds first; None where the runtime cannot poll (_transfer)
    poll_work_done: Any = None

    @property
    def install_hint(self) -> str:
        return f"{self.module} is not installed: pip install paged_sparse_attn[{self.extra}]"

    def installed(self) -> bool:
        """Whether the runtime's module can be imported (without importing it)."""
        if self.module in sys.modules:
            return True
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def gpu(self) -> Any:
        """The runtime's module, configured (instance toggles) on first use; ImportError if absent."""
        mod = importlib.import_module(self.module)
        if self.instance_toggles and not _configured.get(self.name):
            _configured[self.name] = True
            try:
                from wgpudawn.backends.dawn import (
                    extras,  # (only Dawn has instance toggles)
                )

                extras.set_instance_extras(enable_toggles=list(self.instance_toggles))
            except RuntimeError:
                # the process created Dawn's instance before us: its toggles stay as they are
                # (f16 or subgroup matrices may then be missing: capabilities say so)
                pass
        return mod

    def wanted_features(self) -> tuple[str, ...]:
        """Features requested when the adapter has them (runtime spelling).

        timestamp-query is always requested (it costs nothing until a query set is written;
        profiling and copy_bandwidth need it); subgroup is what the decode partials kernel needs
        (its shuffles; without it decode calls run the generic kernel); subgroup matrices are
        what the tensor-core kernels need.
        """
        feats = ["shader-f16", "timestamp-query", self.subgroup_feature]
        if self.sgmat_feature:
            feats.append(self.sgmat_feature)
        if self.host_memory_feature:
            feats.append(self.host_memory_feature)
        return tuple(feats)

    def host_memory_module(self) -> Any:
        """The module with ``allocate_host_memory`` and ``create_buffer_from_host_memory``."""
        return importlib.import_module(self.host_memory_extras)

    def logical_features(self, features) -> frozenset:
        """Device features in the host code's names (``subgroup``, ``subgroup-matrix``)."""
        out = set()
        for f in map(str, features):
            if f == self.subgroup_feature:
                out.add(SUBGROUP)
            elif self.sgmat_feature and f == self.sgmat_feature:
                out.add(SUBGROUP_MATRIX)
            else:
                out.add(f)
        return frozenset(out)

    def runtime_feature(self, name: str) -> str:
        """A feature name as the runtime spells it (accepts logical or runtime names)."""
        name = name.replace("_", "-")
        if name in (SUBGROUP, self.subgroup_feature, "subgroups"):
            return self.subgroup_feature
        if name == SUBGROUP_MATRIX and self.sgmat_feature:
            return self.sgmat_feature
        return name

    def request_device(self, adapter, features, limits, *, enable_toggles: tuple[str, ...] = ()):
        """A device of ``adapter``; ``enable_toggles`` are device toggles to add (Dawn only)."""
        if self.device_toggles or enable_toggles:
            from wgpudawn.backends.dawn import extras

            return extras.request_device_sync(adapter, required_features=features, required_limits=limits,
                                              enable_toggles=list(enable_toggles),
                                              disable_toggles=list(self.device_toggles))
        return adapter.request_device_sync(required_features=features, required_limits=limits)

    def null_adapter(self):
        """Dawn's Null adapter: validates everything (WGSL through Tint included) and runs nothing,
        so shaders and device requests are checked without a GPU. A fresh adapter per call (an
        adapter opens one device). Dawn only; ImportError without ``wgpudawn``."""
        if self.name != "dawn":
            raise ValueError(f"runtime {self.name!r} has no Null adapter")
        gpu = self.gpu()
        old = os.environ.get("WGPU_BACKEND_TYPE")
        os.environ["WGPU_BACKEND_TYPE"] = "Null"  # read when the adapter is requested
        try:
            return gpu.gpu.request_adapter_sync()
        finally:
            if old is None:
                del os.environ["WGPU_BACKEND_TYPE"]
            else:
                os.environ["WGPU_BACKEND_TYPE"] = old

    def subgroup_matrix_configs(self, adapter) -> frozenset:
        """(M, N, K) of the adapter's f16 x f16 -> f32 subgroup-matrix configurations (empty if none)."""
        if not self.sgmat_feature or self.sgmat_feature not in set(map(str, adapter.features)):
            return frozenset()
        try:
            from wgpudawn.backends.dawn import _extras_adapter as xa

            configs = xa.get_adapter_properties(adapter).get("subgroup_matrix_configs") or []
        except Exception:  # a capability query never raises: no configurations
            return frozenset()
        return frozenset((int(c["m"]), int(c["n"]), int(c["k"])) for c in configs
                         if c.get("component_type") == "f16" and c.get("result_component_type") == "f32")

    def timestamp_period(self, device) -> float:
        """Nanoseconds per resolved timestamp tick of ``device``'s queue; 1.0 if it cannot tell.

        WebGPU promises nanoseconds, but wgpu-native resolves raw ticks unless asked to
        normalise (on NVIDIA Vulkan and lavapipe the period is 1.0); Dawn resolves nanoseconds.
        """
        if self.name != "wgpu":
            return 1.0
        try:
            from wgpu.backends.wgpu_native._ffi import lib

            period = float(lib.wgpuQueueGetTimestampPeriod(device.queue._internal))
            return period if period > 0 else 1.0
        except Exception:
            return 1.0


_configured: dict[str, bool] = {}


class _DawnWorkDone:
    """Waits for a Dawn queue's submitted work with one callback registration and two C structs
    made once (per thread), instead of wgpudawn's promise per wait.

    ``on_submitted_work_done_async`` registers a callback, builds its structs and a promise on
    every call: 27 us of a decode ``forward()`` on the H200 (2026-12-03). Here the callback is
    registered once with Dawn's ``WaitAnyOnly`` mode (it runs only inside this thread's own
    ``wgpuInstanceWaitAny``, so waits of other threads or devices never see it), and a wait is
    ``wgpuQueueOnSubmittedWorkDone`` and ``wgpuInstanceWaitAny`` calls: with a zero timeout (never
    blocks) for up to ``spin_s`` seconds, then in blocking steps of 0.1 s (as wgpudawn waits, so
    that an interrupt comes through). A status other than success raises ``RuntimeError`` with
    the status, as wgpudawn's promise does.
    """

    def __init__(self):
        from wgpudawn.backends.dawn import (  # (the wgpudawn 0.32 the extra pins)
            _api,
            _ffi,
        )

        ffi, lib = _api.ffi, _api.lib
        self.libf = _api.libf
        self.instance = _api.get_wgpu_instance()
        self.ok = lib.WGPUQueueWorkDoneStatus_Success
        self.waiting = (_api._WAIT_SUCCESS, _api._WAIT_TIMED_OUT)
        self.status: int | None = None
        self.info = ffi.new("WGPUQueueWorkDoneCallbackInfo *")
        self.info.mode = lib.WGPUCallbackMode_WaitAnyOnly
        self.info.callback = _ffi.c_callback("WGPUQueueWorkDoneCallback")
        self.info.userdata1 = _ffi.callbacks.register(self._done, once=False)
        self.wait_info = ffi.new("WGPUFutureWaitInfo *")

    def _done(self, status, _message, _userdata1, _userdata2) -> None:
        self.status = int(status)

    def wait(self, queue, spin_s: float) -> None:
        self.status = None
        w = self.wait_info
        w.future.id = self.libf.wgpuQueueOnSubmittedWorkDone(queue._internal, self.info[0]).id
        w.completed = False
        wait_any, instance = self.libf.wgpuInstanceWaitAny, self.instance
        end = time.perf_counter() + spin_s
        while not w.completed and time.perf_counter() < end:
            wait_any(instance, 1, w, 0)
        while not w.completed:
            status = wait_any(instance, 1, w, 100_000_000)
            if not w.completed and status not in self.waiting:
                raise RuntimeError(f"waiting for the queue's submitted work failed with status {status}")
        if self.status != self.ok:
            raise RuntimeError(f"Queue work done status: {self.status}")


_work_done = threading.local()  # this thread's _DawnWorkDone


def _dawn_poll_work_done(device, spin_s: float) -> None:
    """Dawn: wait for the queue's submitted work, polling (never blocking) for up to ``spin_s``
    seconds first (``_DawnWorkDone``). ``device`` may be the backend's ``DeviceView``: its
    queue submits the open batch first, so that the batch's work is waited for too."""
    queue = device.queue
    flushed = getattr(queue, "flushed", None)
    if flushed is not None:
        queue = flushed()
    w = getattr(_work_done, "w", None)
    if w is None:
        w = _work_done.w = _DawnWorkDone()
    w.wait(queue, spin_s)


WGPU_NATIVE = Runtime(
    name="wgpu", module="wgpu", extra="wgpu",
    subgroup_feature="subgroup", subgroup_directive="", trusted_modules=True, sgmat_feature=None,
    c_module="wgpu.backends.wgpu_native._ffi", api_module="wgpu.backends.wgpu_native._api",
    driver_hint=("no Vulkan/Metal/D3D12 driver found: on Debian/Ubuntu apt-get install mesa-vulkan-drivers "
                 "(lavapipe) or install your GPU driver"),
)

DAWN = Runtime(
    name="dawn", module="wgpudawn", extra="dawn",
    subgroup_feature="subgroups", subgroup_directive="enable subgroups;\n", trusted_modules=False,
    sgmat_feature="chromium-experimental-subgroup-matrix", work_done_wait=True, c_module="wgpudawn._lib",
    api_module="wgpudawn.backends.dawn._api",
    # subgroup matrices are behind allow_unsafe_apis; Dawn offers no f16 on NVIDIA's Vulkan driver
    # without vulkan_enable_f16_on_nvidia (ignored elsewhere)
    instance_toggles=("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"),
    # timestamps at full resolution: the bench compares kernels of tens of microseconds
    device_toggles=("timestamp_quantization",),
    # buffers on host memory (Vulkan's external host memory; behind allow_unsafe_apis)
    host_memory_feature="host-mapped-pointer", host_memory_extras="wgpudawn.backends.dawn._extras_memory",
    poll_work_done=_dawn_poll_work_done,
    driver_hint=("Dawn found no GPU adapter it supports (it needs a Vulkan 1.1 driver with descriptor "
                 "indexing, Metal or D3D12; Mesa's lavapipe CPU driver is not enough): install your GPU "
                 "driver, or use the 'wgpu' backend"),
)


def gpu_error_types() -> tuple[type, ...]:
    """The GPU error classes of every runtime this process has imported (for translation)."""
    types: list[type] = []
    for mod in ("wgpu", "wgpudawn"):
        m = sys.modules.get(mod)
        if m is not None:
            types += [getattr(m, n) for n in ("GPUError", "GPUPipelineError") if hasattr(m, n)]
    return tuple(types)
