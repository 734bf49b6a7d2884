"""The wgpu backend: the KV-outer pipeline (R13-R15) in WGSL on any WebGPU device.

Pipeline of one call (one command encoder, one submit, one readback):

1. the caches are on the device already (:meth:`WgpuBackend.upload_kv_cache`) or the slabs the
   problem reads are uploaded (compactly) for this call;
2. the host plans work items, cache chunks and batches from the KVOuterIndex (``_plan``);
3. per batch: ``psa_partials.wgsl`` once per cache chunk, then ``psa_merge.wgsl`` (the combine for
   ``forward``, the merge of per-chunk pieces for ``forward_partials`` when a block spans chunks);
4. the results are copied to mappable buffers and read back once.

``wgpu`` is imported lazily: importing this module does not need it; :meth:`WgpuBackend.probe`
reports why the backend cannot run instead of raising.
"""

from __future__ import annotations

import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from ..._types import (
    AttentionInputs,
    Availability,
    Capabilities,
    DeviceArray,
    KVOuterIndex,
    Partials,
)
from ...errors import DeviceError, SpecError, UnsupportedError
from ..base import Backend
from ._arrays import CacheLayout, WgpuArray, upload_slabs
from ._batch import drop
from ._decode import KERNELS, choose_decode_geometry, decode_ineligible
from ._device import (
    DeviceContext,
    after_device_error,
    destroy_all,
    device_errors,
    open_device,
    subgroup_size,
)
from ._host_io import MAX_HOST_BYTES, PinnedAccount
from ._index_branch import IndexBranchMixin
from ._kernels import all_trusted, pipeline
from ._plan import (
    BatchPlan,
    Geometry,
    IndexView,
    choose_geometry,
    grid_dispatches,
    partials_grid,
    plan_forward,
    plan_partials,
)
from ._profiling import ProfilingMixin
from ._resident import MERGE_WG, ResidentMixin, layout_bytes, merge_split
from ._runtime import DAWN, WGPU_NATIVE, Runtime
from ._sgmat import choose_sgmat_geometry, sgmat_ineligible
from ._tensors import WgpuTensor, lse_from_ml
from ._tensors import upload as upload_tensor
from ._transfer import CallBuffers, bind_group, read_ranges, wait_queue_spinning
from ._webgpu import BufferUsage, QueryType

__all__ = ["DawnBackend", "WgpuArray", "WgpuBackend", "WgpuTensor"]

PARTIALS = "psa_partials.wgsl"
MERGE = "psa_merge.wgsl"
PARAM_BYTES = 32
MAX_QUERIES = 4096  # timestamp queries per query set (wgpu's limit)
# batch_invariant=True: the generic kernel's geometry as if every slot group had this many edges,
# whatever the batch (the rows of an item and its tiles then never depend on other sequences)
BATCH_INVARIANT_SLOT_EDGES = 4


def _u32_record(*vals) -> np.ndarray:
    rec = np.zeros(PARAM_BYTES // 4, dtype=np.uint32)
    for i, v in enumerate(vals):
        if isinstance(v, float):
            rec[i] = np.array([v], dtype=np.float32).view(np.uint32)[0]
        else:
            rec[i] = int(v)
    return rec


class WgpuBackend(ResidentMixin, ProfilingMixin, IndexBranchMixin, Backend):
    """KV-outer sparse attention in WGSL through wgpu (Vulkan, Metal, D3D12; lavapipe on CPUs).

    Parameters
    ----------
    power_preference : {"high-performance", "low-power"}
        Adapter choice.
    required_limits : {"adapter", "default"} or dict
        ``"adapter"`` (default): the adapter's maximal limits. ``"default"``: WebGPU's default
        limits (8 storage buffers per stage, 128 MiB bindings, 16 KiB workgroup memory), to check
        portability. A dict overrides single limits on top of the defaults.
    max_binding_size : int, optional
        Lower the effective storage binding size (bytes). Caches are split into chunks of at most
        this size and calls into batches whose buffers fit it; used to exercise the split paths.
    max_workgroups_per_dim : int, optional
        Lower the workgroups-per-dimension limit; used to exercise multi-dimensional and split
        dispatches.
    disable_features : tuple of str
        Device features not to request, e.g. ``("shader-f16",)`` (float16 is then unsupported).
    workgroup_size : int, optional
        Invocations per workgroup of the partials kernels (at least 64; default: chosen per call
        from the kernel and the workgroup memory, see the backend's page).
    partials_kernel : {"auto", "generic", "decode", "sgmat"}
        Partials kernel. ``"decode"``: ``psa_partials_decode.wgsl``, specialised for calls where
        every selected (KV head, block) is read by exactly one query (one query per sequence);
        a call it cannot run raises :class:`~paged_sparse_attn.UnsupportedError` naming why.
        ``"sgmat"``: ``psa_partials_sgmat.wgsl``, the matrix products on 16x16x16 float16
        subgroup matrices (tensor cores), for float16 caches on devices that have them (the
        Dawn runtime); a call it cannot run raises likewise. ``"generic"``: ``psa_partials.wgsl``
        (f32 FMAs) always. ``"auto"`` (default): decode when it applies, else sgmat when it
        applies, else generic.
    scores_kernel : {"auto", "fma", "sgmat"}
        Block-score kernel of the index branch for items of more than 8 rows (prefill).
        ``"sgmat"``: ``psa_block_scores_sgmat.wgsl``, the logits on 16x16x16 float16 subgroup
        matrices (tensor cores), for float16 HND index keys on devices that have them (the Dawn
        runtime); a call it cannot run raises :class:`~paged_sparse_attn.UnsupportedError`
        naming why. ``"fma"``: ``psa_block_scores.wgsl`` (f32 FMAs) always. ``"auto"`` (default):
        the tensor-core kernel where it applies (on the H200 5.4 against 8.2 ms for the FMA
        kernel on the MSA prefill shape), else the FMA kernel. Decode items keep their own
        kernels either way.
    decode_workgroup_size : int, optional
        Invocations per workgroup of the decode kernel, for tuning experiments: rounded up to a
        power of two that is a multiple of the subgroup size and of the key group (default: one
        subgroup). The geometry used is reported in :attr:`last_timings` (``"geometry"``).
    decode_prefetch : bool, optional
        Whether the decode kernel issues the next chunk's loads before the current chunk's math,
        for tuning experiments (default: by cache dtype).
    layers_per_submission : int
        Planned layers on device arrays (``AttentionPlan.run`` / ``run_sparse`` with device ``q``,
        ``selected`` / ``index_q``, results left on the device) recorded into one command encoder
        and submitted together (R36): every this many layers, and at once before any other use of
        the device's queue (another call, an upload or write, a read of results,
        ``synchronize()``). Default 4: on the H200 Dawn's pipelined decode attention loop ran at
        98 against 159 µs per layer with one submission each. 1 submits every layer by itself.
    timestamps : bool
        Record GPU time per kernel in :attr:`last_timings` (needs the ``timestamp-query``
        feature; ignored without it).
    max_host_bytes : int
        Pinned host memory this backend's plans may hold at once, on runtimes whose buffers can
        be made of host memory (Dawn's ``host-mapped-pointer``): the result blocks of calls with
        host arrays and the blocks of large host queries (``backends/wgpu/_host_io.py``). A
        block past it is not made: that plan reads its results back through a mapped buffer, or
        writes its queries with ``write_buffer``, the same results. Default 1 GiB (a decode plan
        holds at most 16 MiB, the bench's prefill plan up to 259 MiB); 0: none.
    max_device_bytes : int, optional
        Device memory this backend may hold at once: resident caches, the reused scratch and
        the buffers of the call in progress. A call or upload that would exceed it is refused
        with :class:`~paged_sparse_attn.UnsupportedError` before anything is allocated. Default:
        no limit of its own (WebGPU does not report free device memory; an allocation the
        device cannot make raises :class:`~paged_sparse_attn.DeviceError`).
    batch_invariant : bool
        Bits of every row independent of the rest of the batch (R27): the generic partials kernel
        with one geometry for every batch, and the tiled block-score kernel with one tile, instead
        of kernels and tiles chosen from the batch layout (the decode kernels). Off by default:
        it costs decode speed (see the backend's page). Declared in ``capabilities``.
    runtime_checks : bool
        Compile the kernels with the runtime's checks (naga: every index clamped, every loop
        bounded; on ``dawn`` the device's bounds checks, see :class:`DawnBackend`). Default
        ``False``: every kernel of the table (``_kernels.KERNEL_TABLE``, all marked trusted) only
        indexes with values the host has validated and planned (R1-R8, R21-R23 and the plans' own
        checks) or that it has range-checked itself (the KV-outer inversion tests every id of a
        device-resident selection before using it, R31), so the checks cost time (1.3 to 2 times
        on the H200; the prefill block scores 12.8 against 8.4 ms) and protect nothing; ``True``
        is for debugging a kernel change.

    Thread safety: every call on one instance (forward, uploads, page updates, readbacks, release
    of resident arrays, close) holds the instance's lock, so one instance may be shared by threads;
    their calls run one at a time on the device. :attr:`last_timings` is that of the last call of
    any thread.
    """

    name: ClassVar[str] = "wgpu"
    runtime: ClassVar[Runtime] = WGPU_NATIVE  # the WebGPU implementation (wgpu-native; Dawn: DawnBackend)
    _device_toggles: tuple[str, ...] = ()  # device toggles to enable (Dawn: disable_robustness unless DawnBackend(robustness=True))
    _probe_cache: ClassVar[Availability | None] = None

    def __init__(self, *, power_preference: str = "high-performance", required_limits: Any = "adapter",
                 max_binding_size: int | None = None, max_workgroups_per_dim: int | None = None,
                 disable_features: tuple[str, ...] = (), workgroup_size: int | None = None,
                 timestamps: bool = False, max_device_bytes: int | None = None,
                 partials_kernel: str = "auto", runtime_checks: bool = False, batch_invariant: bool = False,
                 decode_workgroup_size: int | None = None, decode_prefetch: bool | None = None,
                 scores_kernel: str = "auto", layers_per_submission: int = 4,
                 max_host_bytes: int = MAX_HOST_BYTES):
        if power_preference not in ("high-performance", "low-power"):
            raise ValueError(f"{type(self).__name__}(): power_preference must be 'high-performance' or 'low-power', "
                             f"got {power_preference!r}")
        self._opts = dict(power_preference=power_preference, required_limits=required_limits,
                          max_binding_size=max_binding_size, max_workgroups_per_dim=max_workgroups_per_dim,
                          disable_features=tuple(disable_features), timestamps=bool(timestamps))
        if partials_kernel not in ("auto", *KERNELS):
            raise ValueError(f"{type(self).__name__}(): partials_kernel must be 'auto', 'generic', 'decode' or 'sgmat', "
                             f"got {partials_kernel!r}")
        self._kernel = partials_kernel
        if scores_kernel not in ("auto", "fma", "sgmat"):
            raise ValueError(f"{type(self).__name__}(): scores_kernel must be 'auto', 'fma' or 'sgmat', "
                             f"got {scores_kernel!r}")
        if batch_invariant and scores_kernel == "sgmat":
            raise ValueError(f"{type(self).__name__}(): batch_invariant=True runs the tiled FMA block-score kernel; "
                             "it cannot be combined with scores_kernel='sgmat'")
        self._scores_kernel = scores_kernel
        if batch_invariant and partials_kernel in ("decode", "sgmat"):
            raise ValueError(f"{type(self).__name__}(): batch_invariant=True runs the generic partials kernel; it cannot be "
                             f"combined with partials_kernel={partials_kernel!r}")
        self._batch_invariant = bool(batch_invariant)
        if isinstance(layers_per_submission, bool) or not isinstance(layers_per_submission, (int, np.integer)) \
                or int(layers_per_submission) < 1:
            raise ValueError(f"{type(self).__name__}(): layers_per_submission must be an int >= 1, "
                             f"got {layers_per_submission!r} [R36]")
        self._layers_per_submission = int(layers_per_submission)
        if isinstance(max_host_bytes, bool) or not isinstance(max_host_bytes, (int, np.integer)) \
                or int(max_host_bytes) < 0:
            raise ValueError(f"{type(self).__name__}(): max_host_bytes must be an int >= 0, got {max_host_bytes!r}")
        self._pinned = PinnedAccount(int(max_host_bytes))  # pinned host memory of the plans (_host_io.py)
        self._kernel_override: str | None = None  # profile_forward(kernel=...)
        if max_device_bytes is not None and int(max_device_bytes) < 1:
            raise ValueError(f"{type(self).__name__}(): max_device_bytes must be >= 1, got {max_device_bytes}")
        self._max_bytes = None if max_device_bytes is None else int(max_device_bytes)
        self._resident: weakref.WeakSet = weakref.WeakSet()  # live WgpuArrays (memory accounting)
        self._lock = threading.RLock()
        self._generation = 0
        self._ctx: DeviceContext | None = None
        self._caps: Capabilities | None = None
        #: Stage times of the last call (seconds), for profiling: ``cache_s`` (cache upload or
        #: lookup), ``plan_s``, ``encode_s`` (buffers and commands), ``gpu_wait_s`` (submit until
        #: the GPU is done), ``readback_s``, ``total_s``; with ``timestamps=True`` also
        #: ``gpu_partials_s`` and ``gpu_merge_s`` (kernel time measured on the GPU).
        self.last_timings: dict = {}
        self._open()
        wg = None if workgroup_size is None else int(workgroup_size)
        if wg is not None and (wg < 64 or wg > self._ctx.max_invocations):  # 64 = ceil(256 / 4): every head dim fits
            raise ValueError(f"{type(self).__name__}(): workgroup_size must be in 64..{self._ctx.max_invocations}, got {wg}")
        self._wg = wg  # None: chosen per call (_shape)
        self._tune: dict = {}  # geometry caps (max_tk, max_rmax) for tuning experiments
        if decode_workgroup_size is not None and not 1 <= int(decode_workgroup_size) <= self._ctx.max_invocations:
            raise ValueError(f"WgpuBackend(): decode_workgroup_size must be in 1..{self._ctx.max_invocations}, "
                             f"got {decode_workgroup_size}")
        self._decode_wg = None if decode_workgroup_size is None else int(decode_workgroup_size)
        self._decode_pf = None if decode_prefetch is None else bool(decode_prefetch)
        self._decode_scores_sg = True  # False: decode block scores one key row per invocation (comparisons)
        self._profiling = False  # profile_forward: timestamps on every pass
        self._one_pass = False  # profile_forward: one timed pass for the whole call, as forward() encodes it
        self._replay = 1  # profile_forward(replay=): passes encoded this many times per call
        self._runtime_checks = bool(runtime_checks)  # False: the table's trusted kernels compiled without them

    # --- availability and device ---------------------------------------------------------------

    @classmethod
    def probe(cls) -> Availability:
        """Whether the runtime's module and an adapter are present (cached; never raises)."""
        if cls._probe_cache is not None:
            return cls._probe_cache
        rt = cls.runtime
        try:
            if not rt.installed():
                avail = Availability(False, rt.install_hint)
            else:
                from ._device import adapter_summary, request_adapter

                adapter = request_adapter("high-performance", rt)
                if adapter is None:
                    avail = Availability(False, rt.driver_hint)
                else:
                    extra = ""
                    configs = rt.subgroup_matrix_configs(adapter)
                    if configs:
                        extra = "; subgroup matrices f16->f32 " + ", ".join(
                            f"{m}x{n}x{k}" for m, n, k in sorted(configs, reverse=True))
                    avail = Availability(True, f"ok: {adapter_summary(adapter)}{extra}")
        except Exception as exc:  # a probe never raises
            avail = Availability(False, f"{rt.module} could not be initialised ({type(exc).__name__}: {exc}); "
                                        f"{rt.driver_hint}")
        cls._probe_cache = avail
        return avail

    def _open(self) -> None:
        self._generation += 1
        self._ctx = open_device(generation=self._generation, runtime=self.runtime,
                                device_toggles=self._device_toggles, **self._opts)
        self._caps = None

    def _device(self) -> DeviceContext:
        with self._lock:  # one device per instance, also when threads race after a loss
            if self._ctx is None:
                self._open()
            return self._ctx

    def synchronize(self) -> None:
        """Wait until every call this backend has accepted has finished on its device (R35).

        Copies nothing back and checks no device-resident selection (R31 raises at the first
        readback of a result). A closed backend has nothing to wait for (no device is opened).
        A pipelined loop of device-resident calls ends with this rather than a ``.numpy()`` when
        it only needs the work done: on an H200 a prefill layer's 64 MiB ``out`` takes longer to
        read back than the layer to compute.
        """
        with self._lock:
            ctx = self._ctx
            if ctx is None:
                return
            try:
                with device_errors("synchronize"):
                    wait_queue_spinning(ctx)  # (polls before it blocks, as torch.cuda.synchronize spins)
            except DeviceError as exc:
                after_device_error(self, exc)  # a lost device: closed, the next call opens a new one
                raise

    def close(self) -> None:
        """Release the device; resident arrays of this backend become unusable, and the plans
        ``forward()`` cached for it are closed (their buffers and pinned host memory released)."""
        from ..._attention_plan import drop_cached_plans

        drop_cached_plans(self)  # (before this backend's lock: a plan takes its own lock first)
        with self._lock:
            ctx, self._ctx = self._ctx, None
            self._generation += 1
            if ctx is not None:
                drop(ctx, DeviceError(f"{type(self).__name__}: the backend was closed before this work was submitted"))
                ctx.pipelines.clear()
                try:
                    ctx.device.destroy()
                except Exception:
                    pass

    @property
    def device_summary(self) -> str:
        return self._device().summary

    @property
    def device_context(self) -> DeviceContext | None:
        """The open device and what is kept per device (a diagnostic, read-only; None after
        :meth:`close`).

        Its ``device`` is the wgpu device, ``pipelines`` the compiled pipelines, ``pool`` and
        ``scratch`` the buffers reused across calls, ``subgroup`` the measured subgroup size.
        For tests and tuning: a call after a device loss opens a new context.
        """
        return self._ctx

    @property
    def capabilities(self) -> Capabilities:
        with self._lock:
            return self._capabilities()

    def _capabilities(self) -> Capabilities:
        if self._caps is None:
            ctx = self._device()
            f16 = "shader-f16" in ctx.features
            limits = dict(ctx.limits)
            limits["effective_storage_binding_size"] = ctx.binding_size
            limits["effective_workgroups_per_dimension"] = ctx.workgroups_per_dim
            if subgroup_size(ctx)[0]:
                limits["measured_subgroup_size"] = subgroup_size(ctx)[0]  # what the decode kernel relies on
            self._caps = Capabilities(
                dtypes=("float32", "float16") if f16 else ("float32",),
                max_head_dim=256,
                max_page_size=128,
                max_block_size=None,
                device_arrays=True,
                deterministic=True, batch_invariant=self._batch_invariant, index_branch=True,
                # subgroup-matrix configurations as features: "subgroup-matrix-f16-16x16x16" (f16 x f16 -> f32)
                features=frozenset(ctx.features) | {f"subgroup-matrix-f16-{m}x{n}x{k}" for m, n, k in ctx.sgmat},
                kv_layouts=("HND", "NHD"),  # R34: both read in place (override RH of the kernels)
                limits=limits,
                device=ctx.summary,
            )
        return self._caps

    def __repr__(self) -> str:
        dev = self._ctx.summary if self._ctx is not None else "closed"
        return f"<{type(self).__name__} {dev!r}>"

    # --- pipelines ---------------------------------------------------------------------------------

    def _pipeline(self, kernel: str, f16: bool, constants: dict[str, int], entry: str = "main"):
        """A pipeline of the kernel table (``_kernels``); the table's trusted kernels without
        runtime checks unless ``runtime_checks=True``."""
        return pipeline(self._device(), kernel, constants, entry=entry, f16=f16, checks=self._runtime_checks)

    # --- plans and device arrays (R30, R32) -------------------------------------------------------

    def plans_forward(self, problem: AttentionInputs) -> bool:
        """Device-resident caches of one storage binding each: ``forward()`` takes the plan path."""
        k, v = problem.k_cache, problem.v_cache
        return (isinstance(k, WgpuArray) and isinstance(v, WgpuArray) and k.backend is self and v.backend is self
                and k.layout.n_chunks == 1 and v.layout.n_chunks == 1 and not self._profiling
                and self._max_bytes is None and self._kernel == "auto" and not self._opts["timestamps"] and not k.released and not v.released)

    def make_runtime(self, layout):
        """The device-resident runtime of a planned batch layout (``_layer.DeviceRuntime``)."""
        from ._layer import DeviceRuntime

        return DeviceRuntime(self, layout)

    def asarray(self, x, *, dtype=None) -> WgpuTensor:
        """Copy a host array (numpy, ``__array__`` or DLPack) to the device (R30).

        Parameters
        ----------
        x : array
            E.g. ``q`` (float32 [Tq, Hq, D]) or ``selected`` (int32 [Tq, Hkv, topk]).
        dtype : dtype, optional
            Must equal ``x``'s dtype when given (no silent cast).

        Returns
        -------
        WgpuTensor
            Pass it to ``forward()`` or ``AttentionPlan.run``; ``.numpy()`` copies it back.
        """
        from ..._validation import as_array

        a = as_array(x, "asarray", "x", "R30")
        if isinstance(a, DeviceArray):
            if a.backend is not self:
                raise UnsupportedError(f"asarray(): x is a device array of {a.backend!r}, not of this backend [R18]")
            return a
        if dtype is not None and np.dtype(dtype) != a.dtype:
            raise SpecError(f"asarray(): x has dtype {a.dtype.name}, dtype={np.dtype(dtype).name} asked; cast it "
                            "first (no silent cast) [R30]", "R30")
        with self._lock:
            return upload_tensor(self, self._device(), np.asarray(a), "array")

    def _read_range(self, buf, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``offset:offset+nbytes`` of a device buffer (COPY_SRC, ``offset`` a multiple of 4,
        the buffer padded to whole words) as a new uint8 array: one copy out of a buffer mapped
        for the read (waits for the work that writes it). (wgpu-py's ``queue.read_buffer`` copies
        twice: 64 MiB took 67 ms on an H200's host, against 20 ms for one copy.)"""
        if nbytes == 0:
            return np.zeros(0, np.uint8)
        dev = self._device().device
        words = nbytes + (-nbytes) % 4  # copies move whole 4-byte words
        with device_errors("readback", bytes=nbytes):
            rb = dev.create_buffer(size=max(16, words), usage=BufferUsage.MAP_READ | BufferUsage.COPY_DST,
                                   label="readback")
            try:
                return read_ranges(dev, buf, [(offset, words)], rb)[0][:nbytes]
            finally:
                rb.destroy()

    # --- the forward pipeline ----------------------------------------------------------------------

    def _cache_layout(self, problem: AttentionInputs, view: IndexView, fn: str) -> tuple[CacheLayout, str]:
        """Where the caches of a call live, decided without allocating anything.

        Returns the layout and what must be uploaded: ``"none"`` (both resident), ``"k"`` or
        ``"v"`` (that host side, in the resident side's full layout) or ``"both"`` (host caches:
        only the slabs this problem reads, compactly numbered).
        """
        k, v = problem.k_cache, problem.v_cache
        ctx = self._device()
        dev = [a for a in (k, v) if isinstance(a, DeviceArray)]
        for a in dev:
            self._own(a, fn)
            a.buffers()  # raises now if released or from a lost device
        self._check_cache_dtype(problem.cache_dtype, fn)
        if len(dev) == 2:
            if k.layout is not v.layout and not k.layout.same_as(v.layout):  # (one object when uploaded together)
                raise UnsupportedError(f"{fn}(): k_cache and v_cache were uploaded with different layouts [R18]")
            return k.layout, "none"
        if len(dev) == 1:  # one side resident: upload the other with the same (full) layout
            return dev[0].layout, ("v" if dev[0] is k else "k")
        shape = (problem.num_pages, problem.num_kv_heads, problem.page_size, problem.head_dim)
        return CacheLayout.make(shape, k.dtype, ctx.binding_size, slab_ids=view.needed_slabs(),
                                kv_layout=problem.kv_layout), "both"

    def _cache_upload(self, problem: AttentionInputs, layout: CacheLayout, upload: str):
        """(k chunk buffers, v chunk buffers, temporaries to free after the call)."""
        k, v = problem.k_cache, problem.v_cache
        dev = self._device().device
        if upload == "none":
            return k.buffers(), v.buffers(), []
        if upload == "k":
            tmp = upload_slabs(dev, np.asarray(k), layout, "k_cache")
            return tmp, v.buffers(), tmp
        if upload == "v":
            tmp = upload_slabs(dev, np.asarray(v), layout, "v_cache")
            return k.buffers(), tmp, tmp
        kb = upload_slabs(dev, k, layout, "k_cache")
        try:
            vb = upload_slabs(dev, v, layout, "v_cache")
        except BaseException:
            for b in kb:
                b.destroy()
            raise
        return kb, vb, kb + vb

    # --- the forward pipeline ----------------------------------------------------------------------

    def forward_partials(self, problem: AttentionInputs, index: KVOuterIndex) -> Partials:
        Hkv = index.num_kv_heads
        G = problem.num_q_heads // Hkv
        D = problem.head_dim
        E = index.num_edges
        o = np.zeros((E * G, D), dtype=np.float32)
        ml = np.zeros((E * G, 2), dtype=np.float32)
        if E:
            self._run(problem, index, "partials", o, ml)
        l = ml[:, 1].copy()
        # l == 0: attended nothing; a NaN l (NaN/Inf in attended data) stays NaN (R14)
        m = np.where(l != 0, ml[:, 0], np.float32(-np.inf)).astype(np.float32)
        return Partials(o.reshape(E, G, D), m.reshape(E, G), l.reshape(E, G))

    def forward(self, problem: AttentionInputs, index: KVOuterIndex) -> tuple[np.ndarray, np.ndarray]:
        Tq, Hq, D = problem.q.shape
        o = np.zeros((Tq * Hq, D), dtype=np.float32)
        ml = np.zeros((Tq * Hq, 2), dtype=np.float32)
        if index.num_edges:
            self._run(problem, index, "forward", o, ml)
        return o.reshape(Tq, Hq, D), lse_from_ml(ml).reshape(Tq, Hq)  # (the plan path's conversion too)

    def _device_lost(self) -> bool:
        """Whether the current device is lost (then even a 16-byte allocation fails)."""

        ctx = self._ctx
        if ctx is None:
            return False
        try:
            ctx.device.create_buffer(size=16, usage=BufferUsage.STORAGE, label="probe").destroy()
        except Exception:
            return True
        return False

    def _run(self, problem: AttentionInputs, index: KVOuterIndex, mode: str, o: np.ndarray, ml: np.ndarray) -> None:
        with self._lock:
            resident = any(isinstance(a, DeviceArray) for a in (problem.k_cache, problem.v_cache))
            for attempt in (0, 1):
                try:
                    self._run_locked(problem, index, mode, o, ml)
                    return
                except DeviceError as exc:
                    if not after_device_error(self, exc):  # (closed when lost: a new device next time)
                        raise
                    if attempt or resident:  # resident caches died with the device: the caller re-uploads
                        raise
                    # host inputs only: nothing was lost but the device; run again on a new one

    def _run_locked(self, problem, index, mode, o, ml) -> None:
        fn = "forward" if mode == "forward" else "forward_partials"
        t0 = time.perf_counter()
        self.last_timings = timings = {}
        ctx = self._device()
        Tq, Hq, D = problem.q.shape
        Hkv = index.num_kv_heads
        G = Hq // Hkv
        view = IndexView(index, G)
        layout, upload = self._cache_layout(problem, view, fn)
        t1 = time.perf_counter()
        # plan everything and check the memory it needs before allocating anything
        # the kernel and its tiles follow the batch layout (the most queries a sequence has, an
        # upper bound of the queries reading one block), not this selection: a plan (which never
        # sees the selection on the host) picks the same, and so computes the same bits (R19)
        layout_view = SimpleNamespace(max_slot_edges=max(1, int(np.diff(index.cu_seqlens_q).max(initial=1))),
                                      index=index)
        geom = self._geometry(ctx, layout_view, D, G, layout.itemsize, fn)
        plans = (plan_forward if mode == "forward" else plan_partials)(view, geom, layout.slab_map(), ctx.binding_size)
        if self._max_bytes is not None:  # (the accounting is only needed under a budget)
            upload_bytes = {"none": 0, "k": 1, "v": 1, "both": 2}[upload] * layout_bytes(layout)
            self._check_budget(fn, {"cache upload": upload_bytes, **self._call_bytes(ctx, plans, geom)})
        t2 = time.perf_counter()
        kbufs, vbufs, temps = self._cache_upload(problem, layout, upload)
        try:
            t3 = time.perf_counter()
            q_rows = problem.q.reshape(Tq * Hkv, G * D)
            self._execute(ctx, plans, q_rows, geom, layout, kbufs, vbufs, float(problem.softmax_scale),
                          normalize=(mode == "forward"), o=o, ml=ml, timings=timings,
                          reuse_bind_groups=not temps)
            timings.update(cache_s=(t1 - t0) + (t3 - t2), plan_s=t2 - t1, total_s=time.perf_counter() - t0,
                           batches=len(plans), chunks=layout.n_chunks, geometry=geom,
                           kernel=getattr(geom, "kernel", PARTIALS))
        finally:
            destroy_all(temps)

    def _geometry(self, ctx: DeviceContext, view: IndexView, D: int, G: int, itemsize: int, fn: str) -> Geometry:
        """Geometry of the partials kernel of a call: decode or generic (``partials_kernel``).

        Kept per device for the inputs it depends on (a decode loop asks for the same one on
        every step); refusals are not kept.
        """
        index = view.index
        if self._batch_invariant:  # R27: one geometry whatever the batch (the generic kernel, fixed rows)
            view = SimpleNamespace(max_slot_edges=BATCH_INVARIANT_SLOT_EDGES, index=index)
        key = (self._kernel_override or self._kernel, self._batch_invariant, self._wg, self._decode_wg, self._decode_pf,
               tuple(sorted(self._tune.items())),
               D, G, itemsize,
               index.page_size, index.block_size, view.max_slot_edges)
        cache = ctx.geometries
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = self._choose_geometry(ctx, view, D, G, itemsize, fn)
        return hit

    def _choose_geometry(self, ctx: DeviceContext, view: IndexView, D: int, G: int, itemsize: int,
                         fn: str) -> Geometry:
        index = view.index
        want = "generic" if self._batch_invariant else (self._kernel_override or self._kernel)
        if want in ("auto", "decode"):
            sg = subgroup_size(ctx)
            why = decode_ineligible(D=D, max_slot_edges=view.max_slot_edges, wg_limit=ctx.max_invocations,
                                    kv_itemsize=itemsize, subgroup=sg)
            if why is None:
                try:
                    return choose_decode_geometry(D=D, S=index.page_size, G=G,
                                                  kv_itemsize=itemsize, wg_storage=ctx.workgroup_storage,
                                                  wg_limit=ctx.max_invocations, subgroup_size=sg[0],
                                                  wg_size=self._decode_wg or self._wg, prefetch=self._decode_pf)
                except UnsupportedError as exc:
                    why = str(exc)
            if want == "decode":
                raise UnsupportedError(f"{fn}(): backend 'wgpu' cannot use the decode partials kernel: {why}; "
                                       "use partials_kernel='auto' or 'generic' [R18]")
        if want in ("auto", "sgmat"):
            rows = G * max(1, view.max_slot_edges)
            why = sgmat_ineligible(ctx, D=D, kv_itemsize=itemsize, block_size=index.block_size, rows_needed=rows)
            if why is None:
                return choose_sgmat_geometry(ctx, D=D, S=index.page_size, G=G, block_size=index.block_size,
                                             rows_needed=rows, kv_itemsize=itemsize)
            if want == "sgmat":
                raise UnsupportedError(f"{fn}(): backend '{self.name}' cannot use the subgroup-matrix partials kernel: "
                                       f"{why}; use partials_kernel='auto' or 'generic' [R18]")
        return choose_geometry(D=D, S=index.page_size, G=G, block_size=index.block_size,
                               rows_needed=G * max(1, view.max_slot_edges), kv_itemsize=itemsize,
                               wg_storage=ctx.workgroup_storage,
                               **{**self._shape(ctx, G * max(1, view.max_slot_edges)), **self._tune})

    def _shape(self, ctx: DeviceContext, rows_needed: int) -> dict:
        """Workgroup size and tile cap of the partials kernel for a call.

        Decode-like calls (a block is read by one query: at most 16 rows per work item) get 128
        invocations and tiles of up to 64 keys: twice the loads in flight per workgroup and half
        the barriers per block. Prefill-like calls get 256 invocations, so that a work item holds
        up to 32 rows (4 queries x 8 heads) and every K/V tile is reused 4 times more than with
        64 invocations. ``workgroup_size=`` fixes the size instead.
        """
        if self._wg is not None:
            return dict(wg_size=self._wg)
        wg = 128 if rows_needed <= 16 else 256
        return dict(wg_size=min(wg, ctx.max_invocations), max_tk=64 if rows_needed <= 16 else 32)

    def _scratch(self, ctx: DeviceContext, o_bytes: int, ml_bytes: int):
        """Partials scratch buffers, kept across calls and grown when a call needs more."""

        have = ctx.scratch
        if have is None or have[0].size < o_bytes or have[1].size < ml_bytes:
            if have is not None:
                ctx.scratch = None
                for b in have:
                    b.destroy()
            usage = BufferUsage.STORAGE
            o_buf = ctx.device.create_buffer(size=max(16, o_bytes), usage=usage, label="partials.o")
            try:
                ml_buf = ctx.device.create_buffer(size=max(16, ml_bytes), usage=usage, label="partials.ml")
            except BaseException:
                o_buf.destroy()  # nothing of a failed call stays allocated
                raise
            have = ctx.scratch = (o_buf, ml_buf)
        return have

    def _execute(self, ctx: DeviceContext, plans: list[BatchPlan], q_rows: np.ndarray, geom: Geometry,
                 layout: CacheLayout, kbufs: list, vbufs: list, scale: float, *, normalize: bool,
                 o: np.ndarray, ml: np.ndarray, timings: dict, reuse_bind_groups: bool = False) -> None:
        """Encode, submit and read back ``plans``: one encoder, one submit, one map (``_transfer``).

        ``reuse_bind_groups``: every buffer bound outlives the call (resident caches, pooled
        buffers), so bind groups may be cached across calls.
        """

        if not plans:
            return
        # profile_forward(replay=R): the call's passes are encoded R times back to back (same
        # inputs, same outputs), so the GPU is timed busy instead of between host pauses
        n_pass = sum(1 + (bp.merge_words is not None) for bp in plans)  # with timestamps: passes per replay
        replay = max(1, int(self._replay)) if self._profiling else 1
        replay = min(replay, max(1, MAX_QUERIES // (2 * n_pass)))
        if replay > 1:
            timings["replay"] = replay
        D = geom.D
        f16 = layout.itemsize == 2
        sizes = dict(D=D, G=geom.G, S=geom.S, TK=geom.TK, RMAX=geom.RMAX, batches=len(plans),
                     chunks=layout.n_chunks)
        # Per-call buffers are pooled on the device context and reused (grown when short): buffer
        # creation dominated the host time of small calls. Under a device-memory budget they are
        # made per call and freed, so that nothing but the caches and the scratch stays held.
        pooled = self._max_bytes is None
        bufs = CallBuffers(ctx, pooled)
        cache_bg = reuse_bind_groups and pooled
        U = BufferUsage
        t_enc = time.perf_counter()
        try:
            kernel = getattr(geom, "kernel", PARTIALS)
            what = f"{'forward' if normalize else 'forward_partials'} ({kernel}, {MERGE})"
            with device_errors(what, **sizes):
                dev = ctx.device
                pipe_p, bgl_p = self._pipeline(kernel, f16, {**geom.constants(), **layout.kernel_constants()})
                merge_c, per = merge_split(D, plans, ctx.workgroups_per_dim)
                pipe_m, bgl_m = self._pipeline(MERGE, False, merge_c)
                lanes = D // merge_c["DV"]  # invocations per destination
                scratch_rows = max([p.n_prows for p in plans if not p.identity] or [0])
                scratch_o = scratch_ml = None
                if scratch_rows:
                    scratch_o, scratch_ml = self._scratch(ctx, scratch_rows * D * 4, scratch_rows * 8)
                qset = None
                one_pass = self._one_pass  # (set by profile_forward only)
                if (self._opts["timestamps"] or self._profiling) and "timestamp-query" in ctx.features:
                    qset = dev.create_query_set(type=QueryType.timestamp,
                                                count=2 * replay if one_pass else 2 * n_pass * replay)
                split = qset is not None and not one_pass  # a timed pass per partials / merge run
                maxdim = ctx.workgroups_per_dim
                align = ctx.uniform_align
                # every batch's buffers first (uploads written), then the commands
                batches = []
                rb_bytes = 0
                for bi, bp in enumerate(plans):
                    q_local = np.ascontiguousarray(q_rows[bp.q_rows], dtype=np.float32)
                    qbuf = bufs.upload(q_local, U.STORAGE, "q", bi)
                    planbuf = bufs.upload(bp.plan_words, U.STORAGE, "plan", bi)
                    out_o = bufs.get(bp.n_dest * D * 4, U.STORAGE | U.COPY_SRC, "out.o", bi)
                    out_ml = bufs.get(bp.n_dest * 8, U.STORAGE | U.COPY_SRC, "out.ml", bi)
                    records, calls = [], []
                    for chunk, first, count in bp.dispatches:
                        for f2, c2, gx, gy in grid_dispatches(count, maxdim):
                            gx, gy = partials_grid(c2, gx, gy, geom, maxdim)
                            records.append(_u32_record(first + f2, c2, gx, geom.G, layout.slab_stride // 4, scale))
                            calls.append(("p", chunk, gx, gy))
                    if bp.merge_words is not None:
                        for d0 in range(0, bp.n_dest, per):
                            nd = min(per, bp.n_dest - d0)
                            wgs = -(-nd * lanes // MERGE_WG)
                            gx = min(wgs, maxdim)
                            gy = -(-wgs // gx)
                            records.append(_u32_record(d0, nd, gx, bp.elem_off, int(normalize), bp.group_size))
                            calls.append(("m", None, gx, gy))
                    params = np.zeros((len(records), align // 4), dtype=np.uint32)
                    for i, r in enumerate(records):
                        params[i, :r.shape[0]] = r
                    pbuf = bufs.upload(params, U.UNIFORM, "params", bi)
                    mbuf = bufs.upload(bp.merge_words, U.STORAGE, "merge", bi) if bp.merge_words is not None else None
                    # results of batch bi at rb_off in the one readback buffer: o, then (m, l)
                    batches.append((bp, qbuf, planbuf, out_o, out_ml, pbuf, mbuf, calls, rb_bytes))
                    rb_bytes += bp.n_dest * D * 4 + bp.n_dest * 8
                rb = bufs.get(rb_bytes, U.MAP_READ | U.COPY_DST, "rb")

                enc = dev.create_command_encoder(label="paged_sparse_attn")
                pass_kinds: list = []
                pass_rep: list = []
                cp = None
                for rep, bi, (bp, qbuf, planbuf, out_o, out_ml, pbuf, mbuf, calls, rb_off) in (
                        (r, j, b) for r in range(replay) for j, b in enumerate(batches)):
                    part_o, part_ml = (out_o, out_ml) if bp.identity else (scratch_o, scratch_ml)
                    for i, (kind, chunk, gx, gy) in enumerate(calls):
                        # one pass for the whole call (wgpu orders the dispatches of a pass by
                        # their buffer usage); with timestamps one per partials / merge run, or
                        # (one_pass) one per replay of the call
                        if cp is None or (split and (i == 0 or (kind == "m" and calls[i - 1][0] == "p"))) or (
                                one_pass and qset is not None and i == 0 and bi == 0):
                            if cp is not None:
                                cp.end()
                            tw = None
                            if qset is not None:
                                slot = 2 * len(pass_kinds)
                                tw = {"query_set": qset, "beginning_of_pass_write_index": slot,
                                      "end_of_pass_write_index": slot + 1}
                                pass_kinds.append(kind)
                                pass_rep.append(rep)
                            cp = enc.begin_compute_pass(timestamp_writes=tw)
                        pres = {"buffer": pbuf, "offset": i * align, "size": PARAM_BYTES}
                        if kind == "p":
                            res = [pres, {"buffer": qbuf}, {"buffer": kbufs[chunk]}, {"buffer": vbufs[chunk]},
                                   {"buffer": planbuf}, {"buffer": part_o}, {"buffer": part_ml}]
                            pipe, bgl = pipe_p, bgl_p
                        else:
                            res = [pres, {"buffer": scratch_o}, {"buffer": scratch_ml}, {"buffer": mbuf},
                                   {"buffer": out_o}, {"buffer": out_ml}]
                            pipe, bgl = pipe_m, bgl_m
                        cp.set_pipeline(pipe)
                        cp.set_bind_group(0, bind_group(ctx, bgl, res, cache_bg))
                        cp.dispatch_workgroups(gx, gy, 1)
                    if split and cp is not None:
                        cp.end()
                        cp = None
                if cp is not None:
                    cp.end()
                for bp, _, _, out_o, out_ml, _, _, _, rb_off in batches:
                    nb = bp.n_dest * D * 4
                    enc.copy_buffer_to_buffer(out_o, 0, rb, rb_off, nb)
                    enc.copy_buffer_to_buffer(out_ml, 0, rb, rb_off + nb, bp.n_dest * 8)
                rb_ts = None
                if qset is not None and pass_kinds:
                    n_q = 2 * len(pass_kinds)
                    resolved = bufs.get(n_q * 8, U.QUERY_RESOLVE | U.COPY_SRC, "ts")
                    rb_ts = bufs.get(n_q * 8, U.MAP_READ | U.COPY_DST, "rb.ts")
                    enc.resolve_query_set(qset, 0, n_q, resolved, 0)
                    enc.copy_buffer_to_buffer(resolved, 0, rb_ts, 0, n_q * 8)
                t_sub = time.perf_counter()
                dev.queue.submit([enc.finish()])
                view = bufs.map_read(rb, rb_bytes)  # waits for the submission
                t_done = time.perf_counter()
                res_all = np.frombuffer(view, dtype=np.float32)
                for bp, _, _, _, _, _, _, _, rb_off in batches:
                    nb = bp.n_dest * D * 4
                    o[bp.dest] = res_all[rb_off // 4:(rb_off + nb) // 4].reshape(-1, D)
                    ml[bp.dest] = res_all[(rb_off + nb) // 4:(rb_off + nb) // 4 + 2 * bp.n_dest].reshape(-1, 2)
                del res_all, view
                rb.unmap()
                timings.update(encode_s=t_sub - t_enc, gpu_wait_s=t_done - t_sub,
                               readback_s=time.perf_counter() - t_done)
                if rb_ts is not None:
                    n_q = 2 * len(pass_kinds)
                    ts = np.frombuffer(bufs.map_read(rb_ts, n_q * 8), dtype=np.uint64).astype(np.int64).reshape(-1, 2)
                    rb_ts.unmap()
                    dt = (ts[:, 1] - ts[:, 0]) * ctx.ns_per_tick * 1e-9
                    if one_pass:  # a pass per replay, holding the whole call
                        timings.update(gpu_call_s=float(np.median(dt)))
                        return
                    kinds = np.array(pass_kinds)
                    reps = np.array(pass_rep)
                    per = [(float(dt[(kinds == "p") & (reps == r)].sum()), float(dt[(kinds == "m") & (reps == r)].sum()),
                            float((ts[reps == r, 1].max() - ts[reps == r, 0].min()) * ctx.ns_per_tick * 1e-9))
                           for r in range(replay)]
                    timings.update(gpu_partials_s=float(np.median([x[0] for x in per])),
                                   gpu_merge_s=float(np.median([x[1] for x in per])),
                                   gpu_total_s=float(np.median([x[2] for x in per])), gpu_replays=per)
        finally:
            bufs.close()


class DawnBackend(WgpuBackend):
    """The same WGSL kernels and host code on Dawn (Google's WebGPU, through ``wgpudawn``).

    Takes every option of :class:`WgpuBackend`. What Dawn adds: the subgroup-matrix feature
    (tensor cores from WGSL) on devices that have it, lower host cost per call. What it lacks:
    shader modules without runtime checks one by one (Dawn's bounds checks are on or off for the
    whole device: ``robustness`` below), and Mesa's lavapipe CPU driver (Dawn needs a GPU driver). The instance
    toggles ``allow_unsafe_apis`` (subgroup matrices) and ``vulkan_enable_f16_on_nvidia`` (float16
    on NVIDIA's Vulkan driver) are set before the process's first Dawn adapter request; if the
    process created Dawn's instance earlier, the features those toggles unlock may be missing,
    which ``capabilities`` shows.
    """

    name: ClassVar[str] = "dawn"
    runtime: ClassVar[Runtime] = DAWN
    _probe_cache: ClassVar[Availability | None] = None

    def __init__(self, *, robustness: bool | None = None, **options: Any):
        """``robustness``: Dawn's bounds checks (every index clamped, every loop guarded), which
        Dawn applies to all kernels of a device or none (its device toggle ``disable_robustness``).
        Default ``None``: off, as ``wgpu`` compiles its kernels without runtime checks, when every
        kernel of the table is trusted (``_kernels.all_trusted()``) and ``runtime_checks`` is not
        set; else on. ``True`` keeps them (for debugging a kernel change), ``False`` drops them.
        Measured on an H200 (GPU timestamps): the prefill tensor-core partials 10.0 against 8.0
        ms, the decode partials 103.0 against 92.8 us, the tensor-core GEMM 111 against 238
        TFLOP/s. An out-of-range access without them is undefined behaviour, which is why only
        trusted kernels run so. Every other option is :class:`WgpuBackend`'s."""
        if robustness is None:
            robustness = bool(options.get("runtime_checks", False)) or not all_trusted()
        self.robustness = bool(robustness)
        self._device_toggles = () if robustness else ("disable_robustness",)
        super().__init__(**options)
