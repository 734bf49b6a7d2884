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
from typing import Any

import numpy as np

from ._device import destroy_all, device_errors
from ._shaders import shader_source
from ._webgpu import BufferUsage, MapMode, QueryType

__all__ = ["GEMM_KERNEL", "READ_KERNEL", "copy_bandwidth", "matmul_rate", "median_time", "read_bandwidth", "wait_idle"]

READ_KERNEL = "psa_read_bandwidth.wgsl"
READ_WG = 256
WARMUP_RUNS_PER_SUBMIT = 8


def wait_idle(dev: Any, buf: Any) -> None:
    """Block until the submitted work is done: read 4 bytes of ``buf`` (needs COPY_SRC) back.

    (wgpu-py's ``on_submitted_work_done_sync`` fails with the wgpu-native it ships with.)
    """
    dev.queue.read_buffer(buf, 0, 4)


def median_time(ctx: Any, encode: Callable[[Any, Any], None], wait_buf: Any, repeat: int,
                warmup_s: float = 0.0) -> tuple[float, str]:
    """Median seconds of the commands ``encode(encoder, qset)`` records, and the timer used.

    ``encode`` records one run; with a query set it also writes timestamp 0 at the run's start
    and 1 at its end. First untimed runs for ``warmup_s`` seconds, eight per submission (a GPU
    that has been idle runs at its idle clock at first), then one warm-up run and ``repeat``
    timed ones, one submission each. GPU timestamps when the device has them (``"timestamp-query"``),
    else host time around submit and wait (``"wall"``; ``wait_buf`` needs COPY_SRC).
    """

    dev = ctx.device
    U = BufferUsage
    t_warm = time.perf_counter()
    while time.perf_counter() - t_warm < float(warmup_s):
        enc = dev.create_command_encoder()
        for _ in range(WARMUP_RUNS_PER_SUBMIT):  # the GPU stays busy between host round trips
            encode(enc, None)
        dev.queue.submit([enc.finish()])
        wait_idle(dev, wait_buf)
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
                wait_idle(dev, wait_buf)
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

            t, timer = median_time(ctx, encode, dst, repeat)
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

            def encode(enc, qset):
                tw = None if qset is None else {"query_set": qset, "beginning_of_pass_write_index": 0,
                                                "end_of_pass_write_index": 1}
                cp = enc.begin_compute_pass(timestamp_writes=tw)
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(groups)
                cp.end()

            t, timer = median_time(ctx, encode, sink, repeat, warmup_s)
    finally:
        destroy_all(bufs)
    return dict(bytes_per_s=n / t if t > 0 else float("nan"), read_s=t, read_bytes=n, timer=timer)


GEMM_KERNEL = "psa_gemm_sgmat.wgsl"
GEMM_TILES = ((4, 2), (2, 4), (4, 4), (2, 2))  # (TM, TN) result tiles per subgroup tried


def matmul_rate(ctx: Any, size: int = 4096, repeat: int = 10) -> dict:
    """FLOP/s of ``psa_gemm_sgmat.wgsl``: C = A · B, f16 [size, size] operands, f32 result.

    Tries each tile shape of ``GEMM_TILES`` and returns the fastest: ``dict(flop_per_s, gemm_s,
    size, tiles, max_abs_err, timer)``, where ``max_abs_err`` compares 64 rows of C with numpy
    (the rate of a wrong product is worthless). Needs the subgroup-matrix feature (16x16x16).
    """
    from ._kernels import pipeline

    n = max(64, int(size) - int(size) % 64)
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((n, n)) * 0.1).astype(np.float16)
    b = (rng.standard_normal((n, n)) * 0.1).astype(np.float16)
    dev = ctx.device
    U = BufferUsage
    bufs = []
    best = None
    try:
        with device_errors("matmul_rate", size=n):
            ab = dev.create_buffer_with_data(data=a, usage=U.STORAGE)
            bb = dev.create_buffer_with_data(data=b, usage=U.STORAGE)
            cb = dev.create_buffer(size=n * n * 4, usage=U.STORAGE | U.COPY_SRC)
            pb = dev.create_buffer_with_data(data=np.array([n, n, n, 0], np.uint32), usage=U.UNIFORM)
            bufs += [ab, bb, cb, pb]
            for tm, tn in GEMM_TILES:
                pipe, bgl = pipeline(ctx, GEMM_KERNEL, {"TM": tm, "TN": tn})
                bg = dev.create_bind_group(layout=bgl, entries=[
                    {"binding": i, "resource": {"buffer": x}} for i, x in enumerate((pb, ab, bb, cb))])

                def encode(enc, qset, pipe=pipe, bg=bg, tm=tm, tn=tn):
                    tw = None if qset is None else {"query_set": qset, "beginning_of_pass_write_index": 0,
                                                    "end_of_pass_write_index": 1}
                    cp = enc.begin_compute_pass(timestamp_writes=tw)
                    cp.set_pipeline(pipe)
                    cp.set_bind_group(0, bg)
                    cp.dispatch_workgroups(n // (16 * tn), n // (16 * tm))
                    cp.end()

                t, timer = median_time(ctx, encode, cb, repeat)
                c = np.frombuffer(dev.queue.read_buffer(cb, 0, 64 * n * 4), np.float32).reshape(64, n)
                err = float(np.abs(c - a[:64].astype(np.float32) @ b.astype(np.float32)).max())
                row = dict(flop_per_s=2.0 * n ** 3 / t if t > 0 else float("nan"), gemm_s=t, size=n,
                           tiles=(tm, tn), max_abs_err=err, timer=timer)
                if best is None or row["flop_per_s"] > best["flop_per_s"]:
                    best = row
    finally:
        destroy_all(bufs)
    return best
