"""Ceilings of a device measured through wgpu: a buffer copy and a streaming read.

The benchmark reports a backend's kernel times against the memory floor; the floor's bandwidth
is the best the run measured. :func:`copy_bandwidth` times ``copy_buffer_to_buffer``;
:func:`read_bandwidth` gives the rate a kernel reaches when it only reads
(``psa_read_bandwidth.wgsl``), through the same API, compiler and driver as our kernels: the
ceiling for a read-bound kernel such as decode on this stack. Both time their commands the same
way (:func:`median_time`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import DeviceError, UnsupportedError
from ._device import destroy_all, device_errors, subgroup_size
from ._shaders import shader_source
from ._transfer import wait_queue
from ._webgpu import BufferUsage, MapMode, QueryType

__all__ = ["GEMM_KERNEL", "GEMM_TILED_KERNEL", "GEMM_VARIANTS", "READ_KERNEL", "GemmVariant", "copy_bandwidth",
           "gemm_error_bound", "matmul_rate", "matmul_variants", "median_time", "one_dispatch", "read_bandwidth"]

READ_KERNEL = "psa_read_bandwidth.wgsl"
READ_WG = 256
WARMUP_RUNS_PER_SUBMIT = 8


def one_dispatch(pipe: Any, bind_group: Any, *grid: int) -> Callable[[Any, Any], None]:
    """``encode(encoder, qset)`` for :func:`median_time`: one compute pass of one dispatch of
    ``grid`` workgroups, with timestamps 0 and 1 at its start and end when ``qset`` is given."""

    def encode(enc: Any, qset: Any) -> None:
        tw = None if qset is None else {"query_set": qset, "beginning_of_pass_write_index": 0,
                                        "end_of_pass_write_index": 1}
        cp = enc.begin_compute_pass(timestamp_writes=tw)
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bind_group)
        cp.dispatch_workgroups(*grid)
        cp.end()

    return encode


def median_time(ctx: Any, encode: Callable[[Any, Any], None], repeat: int,
                warmup_s: float = 0.0) -> tuple[float, str]:
    """Median seconds of the commands ``encode(encoder, qset)`` records, and the timer used.

    ``encode`` records one run; with a query set it also writes timestamp 0 at the run's start
    and 1 at its end. First untimed runs for ``warmup_s`` seconds, eight per submission (a GPU
    that has been idle runs at its idle clock at first), then one warm-up run and ``repeat``
    timed ones, one submission each. GPU timestamps when the device has them (``"timestamp-query"``),
    else host time around submit and wait (``"wall"``; the wait is ``_transfer.wait_queue``).
    """

    dev = ctx.device
    U = BufferUsage
    t_warm = time.perf_counter()
    while time.perf_counter() - t_warm < float(warmup_s):
        enc = dev.create_command_encoder()
        for _ in range(WARMUP_RUNS_PER_SUBMIT):  # the GPU stays busy between host round trips
            encode(enc, None)
        dev.queue.submit([enc.finish()])
        wait_queue(ctx)
    use_ts = "timestamp-query" in ctx.features
    bufs = []
    times = []
    try:
        qset = None
        if use_ts:
            qset = dev.create_query_set(type=QueryType.timestamp, count=2)
            res = dev.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)
            rb = dev.create_buffer(size=16, usage=U.MAP_READ | U.COPY_DST)
            bufs += [res, rb]
        for i in range(int(repeat) + 1):
            enc = dev.create_command_encoder()
            encode(enc, qset)
            if use_ts:
                enc.resolve_query_set(qset, 0, 2, res, 0)
                enc.copy_buffer_to_buffer(res, 0, rb, 0, 16)
            t0 = time.perf_counter()
            dev.queue.submit([enc.finish()])
            if use_ts:
                rb.map_sync(MapMode.READ)
                a, b = np.frombuffer(rb.read_mapped(), dtype=np.uint64).astype(np.int64)
                rb.unmap()
                dt = (b - a) * ctx.ns_per_tick * 1e-9
            else:
                wait_queue(ctx)
                dt = time.perf_counter() - t0
            if i:  # the first run warms up
                times.append(dt)
    finally:
        destroy_all(bufs)
    return float(np.median(times)), "timestamp-query" if use_ts else "wall"


def copy_bandwidth(ctx: Any, nbytes: int, repeat: int = 10) -> dict:
    """Bytes/s (read plus written) of ``copy_buffer_to_buffer`` between two buffers of ``nbytes``.

    Timestamps are written by empty compute passes around the copy. Returns
    ``dict(bytes_per_s, copy_s, copy_bytes, timer)``.
    """

    dev = ctx.device
    n = max(256, min(int(nbytes), ctx.buffer_size))
    n -= n % 256
    U = BufferUsage
    bufs = []
    try:
        with device_errors("copy_bandwidth", bytes=n):
            src = dev.create_buffer(size=n, usage=U.COPY_SRC | U.COPY_DST)
            bufs.append(src)
            dst = dev.create_buffer(size=n, usage=U.COPY_SRC | U.COPY_DST)
            bufs.append(dst)

            def encode(enc, qset):
                if qset is not None:
                    enc.begin_compute_pass(timestamp_writes={"query_set": qset, "end_of_pass_write_index": 0}).end()
                enc.copy_buffer_to_buffer(src, 0, dst, 0, n)
                if qset is not None:
                    enc.begin_compute_pass(
                        timestamp_writes={"query_set": qset, "beginning_of_pass_write_index": 1}).end()

            t, timer = median_time(ctx, encode, repeat)
    finally:
        destroy_all(bufs)
    return dict(bytes_per_s=2.0 * n / t if t > 0 else float("nan"), copy_s=t, copy_bytes=n, timer=timer)


def read_bandwidth(ctx: Any, nbytes: int, repeat: int = 10, workgroups: int = 4096, warmup_s: float = 0.0) -> dict:
    """Bytes/s of ``psa_read_bandwidth.wgsl`` reading ``nbytes`` (capped by the binding size).

    Returns ``dict(bytes_per_s, read_s, read_bytes, timer)``: the median of ``repeat`` timed
    runs after ``warmup_s`` seconds of untimed runs and one warm-up run (:func:`median_time`).
    """

    dev = ctx.device
    n = max(4096, min(int(nbytes), ctx.binding_size, ctx.buffer_size))
    n -= n % 4096
    U = BufferUsage
    groups = max(1, min(int(workgroups), ctx.workgroups_per_dim))
    bufs = []
    try:
        with device_errors("read_bandwidth", bytes=n):
            src = dev.create_buffer(size=n, usage=U.STORAGE)
            sink = dev.create_buffer(size=16, usage=U.STORAGE | U.COPY_SRC)
            params = dev.create_buffer(size=16, usage=U.UNIFORM | U.COPY_DST)
            bufs += [src, sink, params]
            dev.queue.write_buffer(params, 0, np.array([n // 16, groups * READ_WG, 0xDEADBEEF, 0], np.uint32))
            module = dev.create_shader_module(code=shader_source(READ_KERNEL), label=READ_KERNEL)
            pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main",
                                                                       "constants": {"WG": READ_WG}})
            bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
                {"binding": 0, "resource": {"buffer": params}},
                {"binding": 1, "resource": {"buffer": src}},
                {"binding": 2, "resource": {"buffer": sink}}])
            t, timer = median_time(ctx, one_dispatch(pipe, bg, groups), repeat, warmup_s)
    finally:
        destroy_all(bufs)
    return dict(bytes_per_s=n / t if t > 0 else float("nan"), read_s=t, read_bytes=n, timer=timer)


GEMM_KERNEL = "psa_gemm_sgmat.wgsl"
GEMM_TILED_KERNEL = "psa_gemm_sgmat_tiled.wgsl"


@dataclass(frozen=True)
class GemmVariant:
    """One kernel and override constants :func:`matmul_rate` tries.

    ``psa_gemm_sgmat.wgsl`` (naive: one subgroup per workgroup, operands from storage) takes
    ``TM, TN``; ``psa_gemm_sgmat_tiled.wgsl`` (operands staged in workgroup memory) takes
    ``SGM, SGN, TM, TN, BK, STAGES`` (and ``PAD``, default 8): read the kernels' headers.
    """

    name: str
    kernel: str
    constants: tuple  # ((name, value), ...): hashable and ordered

    @property
    def c(self) -> dict:
        return dict(self.constants)

    @property
    def tiled(self) -> bool:
        return self.kernel == GEMM_TILED_KERNEL

    @property
    def block(self) -> tuple[int, int, int]:
        """(rows, columns, K step) of C one workgroup computes per step."""
        c = self.c
        if not self.tiled:
            return 16 * c["TM"], 16 * c["TN"], 16
        return 16 * c["TM"] * c["SGM"], 16 * c["TN"] * c["SGN"], c["BK"]

    @property
    def invocations(self) -> int:
        c = self.c
        return 32 * c["SGM"] * c["SGN"] if self.tiled else 32

    @property
    def workgroup_bytes(self) -> int:
        """Workgroup memory the kernel declares with these constants (each variable rounded up
        to 16 bytes, as WebGPU counts it)."""
        if not self.tiled:
            return 0
        c = self.c
        bm, bn, bk = self.block
        pad = c.get("PAD", 8)
        a_bytes = 2 * c["STAGES"] * bm * (bk + pad)
        b_bytes = 2 * c["STAGES"] * bk * (bn + pad)
        return -(-a_bytes // 16) * 16 + -(-b_bytes // 16) * 16

    def unfit(self, ctx: Any, m: int, n: int, k: int) -> str | None:
        """Why this variant cannot run C[m, n] = A[m, k] B[k, n] on ``ctx`` (None if it can)."""
        bm, bn, bk = self.block
        if m % bm or n % bn or k % bk:
            return f"the shape ({m}, {n}, {k}) is not a multiple of the block ({bm}, {bn}, {bk})"
        if self.workgroup_bytes > ctx.workgroup_storage:
            return (f"needs {self.workgroup_bytes} bytes of workgroup memory, the device allows "
                    f"{ctx.workgroup_storage}")
        if self.invocations > ctx.max_invocations:
            return f"needs {self.invocations} invocations per workgroup, the device allows {ctx.max_invocations}"
        if self.tiled:
            size = subgroup_size(ctx)[0]
            if size != 32:
                return f"needs subgroups of 32 (subgroup size {size})"
        return None


def _variant(kernel: str, **constants: int) -> GemmVariant:
    short = "naive" if kernel == GEMM_KERNEL else "tiled"
    name = short + " " + " ".join(f"{k}={v}" for k, v in constants.items())
    return GemmVariant(name, kernel, tuple(constants.items()))


# Each times in well under a second at 4096^3 on an H200; memory per workgroup in brackets.
# seconds of untimed runs before each variant is timed: on the H200 the K-48 block read 206 and
# 218 TFLOP/s after 0.05 s in two runs (the others within a few %), 282-284 in four rounds after 0.3 s
GEMM_WARMUP_S = 0.3
GEMM_VARIANTS: tuple[GemmVariant, ...] = (
    _variant(GEMM_KERNEL, TM=2, TN=2),
    _variant(GEMM_KERNEL, TM=4, TN=2),
    # 128 x 128 blocks of 8 subgroups of 64 x 32, double-buffered (37 KiB)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=4, TM=4, TN=2, BK=32, STAGES=2),
    # the same block in 4 subgroups of 64 x 64 (37 KiB)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=2, TM=4, TN=4, BK=32, STAGES=2),
    # 128 x 128, K steps of 64 in one stage (35 KiB)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=4, TM=4, TN=2, BK=64, STAGES=1),
    # 128 x 128 blocks of 4 subgroups of 64 x 64, K steps of 16 (27 KiB; the fastest on the H200 without
    # bounds checks) and of 8 subgroups of 32 x 64 (37 KiB)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=2, TM=4, TN=4, BK=16, STAGES=2),
    _variant(GEMM_TILED_KERNEL, SGM=4, SGN=2, TM=2, TN=4, BK=32, STAGES=2),
    # 128 x 256 and 256 x 128 blocks of 8 subgroups of 64 x 64 (29, 27 and 33 KiB)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=4, TM=4, TN=4, BK=16, STAGES=2),
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=4, TM=4, TN=4, BK=32, STAGES=1),
    _variant(GEMM_TILED_KERNEL, SGM=4, SGN=2, TM=4, TN=4, BK=16, STAGES=2),
    # 64 x 64 blocks of 4 subgroups of 32 x 32, double-buffered (19 KiB)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=2, TM=2, TN=2, BK=32, STAGES=2),
    # 128 x 256 in K steps of 48, one stage (39 KiB): two barriers per 48 of K instead of per 32;
    # 282 against 265 TFLOP/s on the H200 at 4608^3 (K a multiple of 48: the bench's GEMM_SIZE)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=4, TM=4, TN=4, BK=48, STAGES=1),
    # within WebGPU's default 16 KiB: 128 x 128, K steps of 16, one stage (10 KiB)
    _variant(GEMM_TILED_KERNEL, SGM=2, SGN=4, TM=4, TN=2, BK=16, STAGES=1),
)

GEMM_CHECK_ROWS = 64


def gemm_error_bound(a_rows: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact product of float16 ``a_rows`` [r, k] and ``b`` [k, n] (float64) and the bound on
    any float32 evaluation's error, element by element.

    float16 x float16 products are exact in float32 (11-bit significands), so only the k - 1
    float32 additions round; in any order, with round-to-nearest or truncation (unit roundoff
    u = 2^-23 covers both), |C - A B| <= gamma_k (|A| |B|) with gamma_k = k u / (1 - k u) (Higham,
    Accuracy and Stability of Numerical Algorithms, 3.1). A product that is wrong (a tile or K
    step lost, misplaced or doubled) exceeds it by orders of magnitude.
    """
    a64 = a_rows.astype(np.float64)
    b64 = b.astype(np.float64)
    k = a64.shape[1]
    u = 2.0 ** -23
    gamma = k * u / (1.0 - k * u)
    return a64 @ b64, gamma * (np.abs(a64) @ np.abs(b64))


def check_rows(m: int) -> np.ndarray:
    """The rows of C that are compared with numpy: spread over M so that every block row of
    workgroups and each position within a 16-row matrix is represented."""
    r = min(GEMM_CHECK_ROWS, m)
    step = m // r
    return np.arange(r) * step + np.random.default_rng(1).integers(0, step, r)  # one in each stride


def matmul_variants(ctx: Any, m: int = 4096, n: int | None = None, k: int | None = None, repeat: int = 10,
                    variants: tuple[GemmVariant, ...] = GEMM_VARIANTS, warmup_s: float = GEMM_WARMUP_S,
                    seed: int = 0) -> list[dict]:
    """Time and check C = A · B (A [m, k], B [k, n] float16, C float32) with every variant.

    Returns one dict per variant: ``name, kernel, constants, block, workgroup_bytes, skipped``
    (why it could not run here, else None: it does not fit the device, or the runtime refuses
    its pipeline) and, for those that ran, ``flop_per_s, gemm_s, max_abs_err, err_bound`` (the
    largest element of :func:`gemm_error_bound` over the checked rows), ``ok`` (every checked
    element within its bound; NaN fails) and ``timer``.
    Nothing is raised for a wrong product here: :func:`matmul_rate` does.
    Needs the subgroup-matrix feature (16x16x16).
    """
    from ._kernels import kernel_source, pipeline

    n = m if n is None else n
    k = m if k is None else k
    kernel_source(ctx, GEMM_KERNEL)  # UnsupportedError where the device has no 16x16x16 f16 matrices
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * 0.1).astype(np.float16)
    b = (rng.standard_normal((k, n)) * 0.1).astype(np.float16)
    rows = check_rows(m)
    ref, bound = gemm_error_bound(a[rows], b)
    dev = ctx.device
    U = BufferUsage
    bufs = []
    out = []
    try:
        with device_errors("matmul_variants", m=m, n=n, k=k):
            ab = dev.create_buffer_with_data(data=a, usage=U.STORAGE)
            bb = dev.create_buffer_with_data(data=b, usage=U.STORAGE)
            cb = dev.create_buffer(size=m * n * 4, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
            pb = dev.create_buffer_with_data(data=np.array([m, n, k, 0], np.uint32), usage=U.UNIFORM)
            bufs += [ab, bb, cb, pb]
            for v in variants:
                row = dict(name=v.name, kernel=v.kernel, constants=v.c, block=v.block,
                           workgroup_bytes=v.workgroup_bytes, skipped=v.unfit(ctx, m, n, k))
                out.append(row)
                if row["skipped"]:
                    continue
                try:
                    pipe, bgl = pipeline(ctx, v.kernel, v.c)
                except DeviceError as exc:
                    # a runtime may refuse what the tiled kernel relies on (its float16 matrices
                    # loaded from 16-byte words, read its header): that variant does not run here,
                    # and the row says why
                    row["skipped"] = f"the runtime refuses its pipeline: {exc}"
                    continue
                bg = dev.create_bind_group(layout=bgl, entries=[
                    {"binding": i, "resource": {"buffer": x}} for i, x in enumerate((pb, ab, bb, cb))])
                bm, bn, _ = v.block
                # the previous variant's product must not pass for this one's
                for r in rows:
                    dev.queue.write_buffer(cb, int(r) * n * 4, np.full(n, np.nan, np.float32))
                t, timer = median_time(ctx, one_dispatch(pipe, bg, n // bn, m // bm), repeat, warmup_s)
                c = np.stack([np.frombuffer(dev.queue.read_buffer(cb, int(r) * n * 4, n * 4), np.float32)
                              for r in rows]).astype(np.float64)
                diff = np.abs(c - ref)
                row.update(flop_per_s=2.0 * m * n * k / t if t > 0 else float("nan"), gemm_s=t,
                           max_abs_err=float(diff.max()), err_bound=float(bound.max()), ok=bool(np.all(diff <= bound)), timer=timer)
    finally:
        destroy_all(bufs)
    return out


def matmul_rate(ctx: Any, size: int = 4096, repeat: int = 10) -> dict:
    """FLOP/s of the fastest subgroup-matrix GEMM variant: C = A · B, f16 [size, size] operands,
    f32 result.

    Runs every variant of ``GEMM_VARIANTS`` that fits the device (:func:`matmul_variants`) and
    returns the fastest: ``dict(flop_per_s, gemm_s, size, variant, kernel, constants, tiles,
    block, max_abs_err, err_bound, timer, variants)``, ``variants`` holding every variant's row.
    A product outside the bound of :func:`gemm_error_bound` in any checked element, from any
    variant, raises :class:`~paged_sparse_attn.DeviceError`: a wrong product has no rate.
    Needs the subgroup-matrix feature (16x16x16).
    """
    n = max(256, int(size) - int(size) % 256)
    rows = matmul_variants(ctx, n, repeat=repeat)
    bad = [r for r in rows if not r["skipped"] and not r["ok"]]
    if bad:
        raise DeviceError("WGSL backend: matmul_rate: wrong products (max |C - A B| against the bound of "
                          "f32 accumulation): " + "; ".join(f"{r['name']}: {r['max_abs_err']:.3g} > "
                                                            f"{r['err_bound']:.3g}" for r in bad))
    ran = [r for r in rows if not r["skipped"]]
    if not ran:
        raise UnsupportedError("matmul_rate: no GEMM variant fits this device: "
                               + "; ".join(f"{r['name']}: {r['skipped']}" for r in rows) + " [R18]")
    best = max(ran, key=lambda r: r["flop_per_s"])
    c = best["constants"]
    return dict(flop_per_s=best["flop_per_s"], gemm_s=best["gemm_s"], size=n, variant=best["name"],
                kernel=best["kernel"], constants=c, tiles=(c["TM"], c["TN"]), block=best["block"],
                max_abs_err=best["max_abs_err"], err_bound=best["err_bound"], timer=best["timer"],
                variants=rows)
