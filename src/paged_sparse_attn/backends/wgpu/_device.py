"""Adapter and device acquisition, limits, features and error translation for the WGSL backend.

The runtime (wgpu-native or Dawn, ``_runtime``) is imported inside functions only: importing this
module never requires it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import DeviceError
from ._batch import DeviceView, retire
from ._runtime import SUBGROUP, WGPU_NATIVE, Runtime, gpu_error_types
from ._webgpu import BufferUsage

__all__ = [
    "MAX_PIPELINES",
    "WEBGPU_DEFAULT_LIMITS",
    "DeviceContext",
    "PipelineCache",
    "after_device_error",
    "destroy_all",
    "device_errors",
    "open_device",
    "request_adapter",
    "subgroup_size",
]


# The WebGPU specification's default limits (what a portable program may assume). Requesting
# these instead of the adapter's maxima catches code that only runs on generous hardware.
WEBGPU_DEFAULT_LIMITS: dict[str, int] = {
    "max-texture-dimension-1d": 8192,
    "max-texture-dimension-2d": 8192,
    "max-texture-dimension-3d": 2048,
    "max-texture-array-layers": 256,
    "max-bind-groups": 4,
    "max-bindings-per-bind-group": 1000,
    "max-dynamic-uniform-buffers-per-pipeline-layout": 8,
    "max-dynamic-storage-buffers-per-pipeline-layout": 4,
    "max-sampled-textures-per-shader-stage": 16,
    "max-samplers-per-shader-stage": 16,
    "max-storage-buffers-per-shader-stage": 8,
    "max-storage-textures-per-shader-stage": 4,
    "max-uniform-buffers-per-shader-stage": 12,
    "max-uniform-buffer-binding-size": 65536,
    "max-storage-buffer-binding-size": 134217728,
    "min-uniform-buffer-offset-alignment": 256,
    "min-storage-buffer-offset-alignment": 256,
    "max-vertex-buffers": 8,
    "max-buffer-size": 268435456,
    "max-vertex-attributes": 16,
    "max-vertex-buffer-array-stride": 2048,
    "max-inter-stage-shader-variables": 16,
    "max-color-attachments": 8,
    "max-color-attachment-bytes-per-sample": 32,
    "max-compute-workgroup-storage-size": 16384,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-compute-workgroup-size-y": 256,
    "max-compute-workgroup-size-z": 64,
    "max-compute-workgroups-per-dimension": 65535,
}

# Limits reported in Capabilities.limits.
REPORTED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-workgroup-storage-size",
    "max-compute-workgroups-per-dimension",
    "max-compute-invocations-per-workgroup",
    "min-uniform-buffer-offset-alignment",
    "min-storage-buffer-offset-alignment",
)

MAX_PIPELINES = 64
"""Compiled pipelines a device keeps (least recently used evicted first)."""

MAX_BIND_GROUPS = 64
"""Bind groups a device keeps for reuse (least recently used evicted first)."""


class PipelineCache(OrderedDict):
    """Compiled pipelines by specialisation key; the least recently used go past ``maxsize``.

    A long-running process that meets many problem shapes would otherwise keep every pipeline
    it ever compiled (compiled device code: megabytes each on some drivers); an evicted one is
    compiled again when needed.
    """

    def __init__(self, maxsize: int = MAX_PIPELINES):
        super().__init__()
        self.maxsize = maxsize

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


@dataclass
class DeviceContext:
    """One device and what the kernels may assume about it."""

    adapter: Any
    device: Any
    summary: str
    adapter_type: str
    features: frozenset
    limits: Mapping[str, int]
    binding_size: int  # effective max storage binding (bytes, multiple of 4)
    buffer_size: int  # max buffer size (bytes)
    workgroups_per_dim: int  # effective max workgroups per grid dimension
    workgroup_storage: int  # max workgroup memory (bytes)
    max_invocations: int
    uniform_align: int
    generation: int = 0
    pipelines: dict = field(default_factory=PipelineCache)  # bounded: see PipelineCache
    layouts: dict = field(default_factory=dict)
    scratch: tuple | None = None  # partials scratch buffers (o, ml), reused across calls
    pool: dict = field(default_factory=dict)  # per-call buffers by role, reused and grown
    # pinned host memory of the index branch's large host inputs, by (label, slot): _host_io.call_input
    host_inputs: dict = field(default_factory=dict)
    bind_groups: dict = field(default_factory=lambda: PipelineCache(MAX_BIND_GROUPS))  # see _transfer.bind_group
    geometries: dict = field(default_factory=lambda: PipelineCache(MAX_PIPELINES))  # kernel geometries by call shape
    ns_per_tick: float = 1.0  # timestamp period: resolved query values are ticks of this many ns
    subgroup: tuple = (None, "the subgroup size was not measured")  # (size or None, why not): open_device
    runtime: Runtime = WGPU_NATIVE  # the WebGPU implementation the device comes from
    sgmat: frozenset = frozenset()  # (M, N, K) of the f16 x f16 -> f32 subgroup-matrix configurations
    sync_buffers: tuple | None = None  # (source, mappable) of the 4-byte copy a wait maps: _transfer.wait_queue
    batch: Any = None  # the open batch of planned layers, not yet submitted (_batch.py, R36)
    # nothing submitted since a wait for the whole queue (the device has nothing to do): set by
    # _transfer.wait_queue*, cleared by every submission; an open batch is then submitted after
    # its first layer, so that the device starts at once (_batch.py)
    queue_idle: bool = True

    @property
    def host_memory(self) -> bool:
        """Whether the device makes buffers of host memory (_host_io.py)."""
        f = self.runtime.host_memory_feature
        return f is not None and f in self.features


SUBGROUP_PROBE = "psa_subgroup_size.wgsl"
SUBGROUP_PROBE_WG = 64


def subgroup_size(ctx: DeviceContext) -> tuple[int | None, str]:
    """The subgroup size the device runs compute shaders with, measured when the device is
    opened; ``(None, why)`` when there is no single size the subgroup kernels can rely on.

    Adapters advertise a range (lavapipe: 4..128) rather than the size; this runs
    ``psa_subgroup_size.wgsl`` (one workgroup of 64) and accepts a size only when every
    invocation reports it and lane == invocation index mod size (groups of consecutive lanes).
    """
    return ctx.subgroup


def _measure_subgroup(ctx: DeviceContext) -> tuple[int | None, str]:
    import numpy as np

    from ._shaders import shader_source

    if SUBGROUP not in ctx.features:
        return None, "the device lacks the subgroup feature"
    dev = ctx.device
    try:
        module = dev.create_shader_module(code=ctx.runtime.subgroup_directive + shader_source(SUBGROUP_PROBE),
                                          label=SUBGROUP_PROBE)
        pipe = dev.create_compute_pipeline(layout="auto", compute={
            "module": module, "entry_point": "main", "constants": {"WG": SUBGROUP_PROBE_WG}})
        buf = dev.create_buffer(size=8 * SUBGROUP_PROBE_WG, usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC)
        try:
            bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                       entries=[{"binding": 0, "resource": {"buffer": buf}}])
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(1)
            cp.end()
            dev.queue.submit([enc.finish()])
            got = np.frombuffer(dev.queue.read_buffer(buf), dtype=np.uint32).reshape(-1, 2)
        finally:
            buf.destroy()
    except Exception as exc:  # a probe reports, it does not raise
        return None, f"the subgroup size probe failed: {exc}"
    sizes = np.unique(got[:, 0])
    if sizes.shape[0] != 1:
        return None, f"subgroup sizes vary within a workgroup ({sorted(int(x) for x in sizes)})"
    size = int(sizes[0])
    if size < 1 or not np.array_equal(got[:, 1], np.arange(SUBGROUP_PROBE_WG) % size):
        return None, f"subgroup lanes (size {size}) do not follow the invocation index"
    return size, ""


def request_adapter(power_preference: str = "high-performance", runtime: Runtime = WGPU_NATIVE):
    """Return an adapter of ``runtime`` or None. Raises ImportError when its module is missing."""
    gpu = runtime.gpu()
    try:
        return gpu.gpu.request_adapter_sync(power_preference=power_preference)
    except Exception:  # (Dawn raises when it has only its Null adapter)
        return None


def adapter_summary(adapter) -> str:
    try:
        s = adapter.summary
        if s:
            return str(s)
    except Exception:
        pass
    try:
        info = adapter.info
        return f"{info.get('device', '?')} ({info.get('adapter_type', '?')}) via {info.get('backend_type', '?')}"
    except Exception:
        return "unknown adapter"


def open_device(
    *,
    power_preference: str,
    required_limits: str | Mapping[str, int],
    max_binding_size: int | None,
    max_workgroups_per_dim: int | None,
    disable_features: tuple[str, ...],
    timestamps: bool = False,
    generation: int = 0,
    runtime: Runtime = WGPU_NATIVE,
    device_toggles: tuple[str, ...] = (),
) -> DeviceContext:
    """Request an adapter and a device of ``runtime`` with the options of :class:`WgpuBackend`."""
    from ...errors import BackendUnavailableError

    name = runtime.name
    try:
        runtime.gpu()
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {runtime.install_hint} [R18]") from exc
    adapter = request_adapter(power_preference, runtime)
    if adapter is None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {runtime.driver_hint} [R18]")
    alimits = dict(adapter.limits)
    if isinstance(required_limits, str):
        if required_limits == "adapter":
            req = dict(alimits)
        elif required_limits == "default":
            req = {k: v for k, v in WEBGPU_DEFAULT_LIMITS.items() if k in alimits}
        else:
            raise ValueError(f"{type_name(runtime)}(): required_limits must be 'default', 'adapter' or a dict, "
                             f"got {required_limits!r}")
    else:
        req = {k: v for k, v in WEBGPU_DEFAULT_LIMITS.items() if k in alimits}
        req.update({str(k).replace("_", "-"): int(v) for k, v in dict(required_limits).items()})
    disabled = {runtime.runtime_feature(f) for f in disable_features}
    afeats = {str(f) for f in adapter.features}
    feats = [f for f in runtime.wanted_features() if f in afeats and f not in disabled]
    try:
        device = runtime.request_device(adapter, feats, req, enable_toggles=tuple(device_toggles))
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend {name!r} could not open a device on {adapter_summary(adapter)} "
            f"(features {feats}, limits {required_limits!r}): {exc} [R18]"
        ) from exc
    lim = dict(device.limits)
    binding = int(lim["max-storage-buffer-binding-size"])
    bufsize = int(lim.get("max-buffer-size", binding))
    binding = min(binding, bufsize)
    if max_binding_size is not None:
        if int(max_binding_size) < 256:
            raise ValueError(f"{type_name(runtime)}(): max_binding_size must be >= 256 bytes, got {max_binding_size}")
        binding = min(binding, int(max_binding_size))
    binding -= binding % 4
    wgdim = int(lim["max-compute-workgroups-per-dimension"])
    if max_workgroups_per_dim is not None:
        if int(max_workgroups_per_dim) < 1:
            raise ValueError(f"{type_name(runtime)}(): max_workgroups_per_dim must be >= 1, got {max_workgroups_per_dim}")
        wgdim = min(wgdim, int(max_workgroups_per_dim))
    info = adapter.info
    ctx = DeviceContext(
        adapter=adapter,
        device=device,
        summary=adapter_summary(adapter),
        adapter_type=str(info.get("adapter_type", "")),
        features=runtime.logical_features(device.features),
        limits={k: int(lim[k]) for k in REPORTED_LIMITS if k in lim},
        binding_size=binding,
        buffer_size=bufsize,
        workgroups_per_dim=wgdim,
        workgroup_storage=int(lim["max-compute-workgroup-storage-size"]),
        max_invocations=int(lim["max-compute-invocations-per-workgroup"]),
        uniform_align=max(256, int(lim.get("min-uniform-buffer-offset-alignment", 256))),
        generation=generation,
        ns_per_tick=runtime.timestamp_period(device),
        runtime=runtime,
    )
    if runtime.sgmat_feature in feats:
        ctx.sgmat = runtime.subgroup_matrix_configs(adapter)
    # every use of the queue submits the open batch of planned layers first (R36)
    ctx.device = DeviceView(device, ctx)
    # measured here, with the device, so that no call compiles or allocates anything before its
    # own checks (a refused call must leave the device untouched)
    ctx.subgroup = _measure_subgroup(ctx)
    return ctx


def after_device_error(backend: Any, exc: BaseException) -> bool:
    """The backend's one device-loss policy, applied wherever a call fails: when the device is
    lost (a 16-byte allocation fails), close the backend so that its next call opens a new device
    (device arrays of the old one then say they must be uploaded again). True if it was lost."""
    if isinstance(exc, DeviceError) and backend._device_lost():
        backend.close()
        return True
    return False


def destroy_all(buffers) -> None:
    """Destroy every buffer of ``buffers``; never raises (teardown after an error, finalizers).
    While a batch of planned layers is open they are destroyed after its submission (R36)."""
    buffers = list(buffers)
    if retire(buffers):
        return
    for b in buffers:
        try:
            b.destroy()
        except Exception:
            pass


class device_errors:
    """Translate WebGPU validation / out-of-memory / internal errors into DeviceError with context
    (a context manager: ``with device_errors("what", size=...):``).

    A class rather than a generator: every layer a plan runs enters one, and a generator-based
    context manager costs a few microseconds more per entry."""

    __slots__ = ("sizes", "what")

    def __init__(self, what: str, **sizes: Any):
        self.what = what
        self.sizes = sizes

    def __enter__(self) -> None:
        return None

    def __exit__(self, et, exc, tb) -> bool:
        if exc is None or isinstance(exc, DeviceError):
            return False
        if isinstance(exc, (*gpu_error_types(), MemoryError)):
            ctx = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
            kind = "out of memory" if isinstance(exc, MemoryError) else type(exc).__name__
            raise DeviceError(f"WGSL backend: {self.what} failed ({kind}){' with ' + ctx if ctx else ''}: "
                              f"{exc}") from exc
        return False


def type_name(runtime: Runtime) -> str:
    return "DawnBackend" if runtime.name == "dawn" else "WgpuBackend"


def create_shader_module(device: Any, code: str, label: str, *, checks: bool = True,
                         runtime: Runtime = WGPU_NATIVE) -> Any:
    """A WGSL shader module; ``checks=False`` compiles it without the runtime checks where the
    runtime can (wgpu-native; Dawn keeps them: its equivalent is a device-wide toggle).

    By default naga clamps every array index and bounds every loop (WebGPU's safety rules).
    ``checks=False`` goes through wgpu-native's ``wgpuDeviceCreateShaderModuleTrusted`` with no
    checks: only for kernels whose every index the host has already proved in range (validation
    plus planning), since an out-of-range access is then undefined behaviour on the device.
    """
    if checks or not runtime.trusted_modules:
        return device.create_shader_module(code=code, label=label)
    from wgpu.backends.wgpu_native import _api
    from wgpu.backends.wgpu_native._ffi import ffi, lib

    src = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(code))
    src[0].chain.next = ffi.NULL
    src[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    desc = _api.new_struct_p("WGPUShaderModuleDescriptor *",
                             nextInChain=ffi.cast("WGPUChainedStruct *", src),
                             label=_api.to_c_string_view(label))
    mid = lib.wgpuDeviceCreateShaderModuleTrusted(device._internal, desc, lib.WGPUShaderRuntimeChecks_None)
    if mid == ffi.NULL:
        raise RuntimeError(f"shader module creation failed: {label}")
    return _api.GPUShaderModule(label, mid, device)
