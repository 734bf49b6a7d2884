"""Profiling of the wgpu backend: GPU time of a call's kernels from timestamp queries, and the
device's copy and read bandwidth (the ceilings the benchmarks compare against).

:class:`ProfilingMixin` is part of :class:`~paged_sparse_attn.backends.wgpu.WgpuBackend`.
"""

from __future__ import annotations

import time

import numpy as np

from ..._types import KVOuterIndex, Problem
from ._ceilings import copy_bandwidth, read_bandwidth
from ._decode import KERNELS

__all__ = ["ProfilingMixin", "AUTO_REPLAY_BUSY_S", "AUTO_REPLAY_MAX"]

AUTO_REPLAY_BUSY_S = 0.05  # profile_forward(replay="auto"): GPU time per call to aim for
AUTO_REPLAY_MAX = 500


class ProfilingMixin:
    """``profile_forward``, ``copy_bandwidth`` and ``read_bandwidth``."""

    # --- profiling ---------------------------------------------------------------------------------

    def profile_forward(self, problem: Problem, index: KVOuterIndex, repeat: int = 20,
                        kernel: str | None = None, replay: int | str = 1, warmup_s: float = 0.0) -> dict:
        """GPU time of :meth:`forward` on ``problem`` from timestamp queries (median of ``repeat``).

        Every pass of a forward call is timed (partials, merge); the caches should already be
        device-resident, so no upload is included. The first call (pipeline compilation) is not
        counted. ``kernel`` (``"auto"``, ``"generic"``, ``"decode"`` or ``"sgmat"``) overrides the
        backend's ``partials_kernel`` for these calls.

        Steady state: a GPU that idles between calls (host work between them) runs at its idle
        clock, and so would its timings. ``replay=R`` encodes each call's passes R times back to
        back in its one submission (each replay recomputes the same outputs; the times are the
        median over replays); ``replay="auto"`` picks R so that one call keeps the GPU busy for
        about 50 ms (at least 10 replays): host work between calls then leaves the GPU idle for a
        small fraction of the time only. ``warmup_s`` first runs such calls, untimed, for that
        many seconds, so that the clocks have risen. The benchmark uses ``replay="auto",
        warmup_s=1.0``.

        Returns
        -------
        dict
            ``total_s`` (first pass start to last pass end), ``partials_s`` and ``combine_s``
            (sums over their passes), ``call_s`` (the call's kernels in one compute pass, as
            :meth:`forward` encodes them, timed around that pass: one pass per replay; median;
            None without timestamps), ``wall_s`` (median host time of a whole call), ``repeat``,
            ``timer`` (``"timestamp-query"``, or ``"wall"`` when the device has no timestamps:
            then the three GPU times are the host time around submit and wait), ``kernel`` (the
            partials kernel that ran).
        """
        if kernel is not None and kernel not in ("auto", *KERNELS):
            raise ValueError(f"profile_forward(): kernel must be 'auto', 'generic', 'decode' or 'sgmat', got {kernel!r}")
        runs = []
        calls: list = []
        with self._lock:  # the flags below apply to this thread's calls only
            self._profiling = True
            self._kernel_override = kernel
            try:
                if replay == "auto":
                    self._replay = 1
                    self.forward(problem, index)  # compiles, and gives one replay's GPU time
                    t1 = self.last_timings.get("gpu_total_s") or self.last_timings.get("gpu_wait_s") or 1e-3
                    replay = int(min(AUTO_REPLAY_MAX, max(10, np.ceil(AUTO_REPLAY_BUSY_S / max(t1, 1e-7)))))
                self._replay = max(1, int(replay))
                t_warm = time.perf_counter()
                while time.perf_counter() - t_warm < float(warmup_s):
                    self.forward(problem, index)
                # the calls encoded as forward() encodes them (one pass, no timestamp between the
                # kernels), a timed pass per replay; then a timed pass per kernel run
                self._one_pass = True
                for _ in range(int(repeat)):
                    self.forward(problem, index)
                    if "gpu_call_s" in self.last_timings:
                        calls.append(self.last_timings["gpu_call_s"])
                self._one_pass = False
                for i in range(int(repeat) + 1):
                    t0 = time.perf_counter()
                    self.forward(problem, index)
                    wall = time.perf_counter() - t0
                    if i:
                        runs.append((dict(self.last_timings), wall))
            finally:
                self._one_pass = False
                self._profiling = False
                self._kernel_override = None
                self._replay = 1
        ts = all("gpu_total_s" in t for t, _ in runs) and bool(runs)
        med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
        if ts:
            total = med([t["gpu_total_s"] for t, _ in runs])
            part = med([t["gpu_partials_s"] for t, _ in runs])
            comb = med([t["gpu_merge_s"] for t, _ in runs])
        else:
            total = part = med([t.get("gpu_wait_s", 0.0) / t.get("replay", 1) for t, _ in runs])
            comb = 0.0
        samples = [(t.get("gpu_total_s"), t.get("gpu_partials_s"), t.get("gpu_merge_s")) for t, _ in runs]
        return dict(total_s=total, partials_s=part, combine_s=comb, call_s=med(calls) if calls else None,
                    wall_s=med([w for _, w in runs]),
                    samples=samples,
                    repeat=len(runs), replay=runs[-1][0].get("replay", 1) if runs else 1,
                    timer="timestamp-query" if ts else "wall",
                    kernel=runs[-1][0].get("kernel") if runs else None)

    def copy_bandwidth(self, nbytes: int = 1 << 28, repeat: int = 10) -> float:
        """Device copy bandwidth in bytes/s (bytes read plus bytes written), median of ``repeat``.

        Times ``copy_buffer_to_buffer`` between two device buffers of ``nbytes`` (capped by the
        device's buffer size) with timestamps written by empty compute passes around the copy.
        Without the ``timestamp-query`` feature the host time around submit and wait is used
        instead (which includes the submission latency); :attr:`last_timings` says which
        (``timer``).
        """
        with self._lock:
            r = copy_bandwidth(self._device(), nbytes, repeat)
        self.last_timings = {k: v for k, v in r.items() if k != "bytes_per_s"}
        return r["bytes_per_s"]

    def read_bandwidth(self, nbytes: int = 1 << 30, repeat: int = 10, warmup_s: float = 0.0) -> float:
        """Streaming read bandwidth in bytes/s (bytes read), median of ``repeat``.

        Times ``psa_read_bandwidth.wgsl`` reading one buffer of ``nbytes`` (capped by the
        binding size): what a read-bound kernel can reach through wgpu on this device, after
        ``warmup_s`` seconds of untimed reads (clocks rise under load).
        :attr:`last_timings` holds ``read_s``, ``read_bytes`` and ``timer``.
        """
        with self._lock:
            r = read_bandwidth(self._device(), nbytes, repeat, warmup_s=warmup_s)
        self.last_timings = {k: v for k, v in r.items() if k != "bytes_per_s"}
        return r["bytes_per_s"]

    def matmul_rate(self, size: int = 4096, repeat: int = 10) -> float:
        """Subgroup-matrix (tensor core) f16 matrix product rate in FLOP/s, median of ``repeat``.

        Times the GEMM variants of ``_ceilings.GEMM_VARIANTS`` (``psa_gemm_sgmat.wgsl`` and the
        workgroup-memory tiled ``psa_gemm_sgmat_tiled.wgsl``, the shapes that fit the device) on
        ``size`` x ``size`` x ``size`` (f16 operands, f32 result), checks 64 rows of each against
        numpy within the bound of f32 accumulation (a wrong product raises
        :class:`~paged_sparse_attn.DeviceError`) and returns the fastest rate:
        :attr:`last_timings` holds ``gemm_s``, ``variant``, ``constants``, ``tiles``, ``block``,
        ``max_abs_err``, ``err_bound``, ``timer`` and ``variants`` (every variant's row).
        Raises :class:`~paged_sparse_attn.UnsupportedError` on a device without 16x16x16 f16
        subgroup matrices (wgpu-native has none; Dawn offers them where the driver does).
        """
        from ._ceilings import matmul_rate

        with self._lock:
            r = matmul_rate(self._device(), size, repeat)
        self.last_timings = {k: v for k, v in r.items() if k != "flop_per_s"}
        return r["flop_per_s"]
