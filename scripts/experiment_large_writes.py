"""Experiment: how a large host array reaches the device, on the prefill ``forward()``'s scale.

A prefill ``forward()`` with host arrays writes ``q`` (4096 x 32 x 128 float32: 64 MiB) with
``queue.write_buffer``; on the H200 its encode stage took 22-27 ms for 4.5 ms of GPU work
(2026-12-04 00:16, the ``layer`` suite). This script times, on one device, a write of ``--mib``
MiB followed by a submission and a wait for the queue, median over ``--repeat`` rounds:

* ``one write``: one ``write_buffer`` of the whole array (as the library does);
* ``chunks of N MiB``: the same bytes in consecutive writes of N MiB;
* ``numpy copy``: numpy copying the same bytes between two host arrays (the host's own rate);
* ``pinned copy``: numpy copying them into a buffer of host memory the device maps (Dawn's
  ``host-mapped-pointer``, as ``_host_io.InputBlock``) and a copy command from there;
* ``read back``: the way back, as a plan without host memory reads its results: a copy into a
  mappable buffer, a submission, the map (its wait), the bytes copied out, the unmap;
* ``numpy copy, N threads`` and ``pinned copy, N threads``: the two copies above split into N
  page-aligned slices copied by N threads at once (numpy releases the GIL while it copies).

    python scripts/experiment_large_writes.py [--backend dawn] [--mib 64] [--repeat 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu._transfer import map_read, wait_queue_spinning
from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage

THREADS = (2, 4, 8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    ctx = registry.get_backend(a.backend).device_context
    dev = ctx.device
    n = a.mib << 20
    src = np.random.default_rng(0).standard_normal(n // 4, dtype=np.float32)
    dst = dev.create_buffer(size=n, usage=BufferUsage.STORAGE | BufferUsage.COPY_DST | BufferUsage.COPY_SRC)

    def write(chunk: int):
        raw = src.view(np.uint8)
        for off in range(0, n, chunk):
            dev.queue.write_buffer(dst, off, raw[off:off + chunk])
        dev.queue.submit([dev.create_command_encoder().finish()])
        wait_queue_spinning(ctx)

    host = np.empty_like(src)
    rb = dev.create_buffer(size=n, usage=BufferUsage.MAP_READ | BufferUsage.COPY_DST)

    def read_back():
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(dst, 0, rb, 0, n)
        dev.queue.submit([enc.finish()])
        out = np.frombuffer(map_read(rb, n), dtype=np.float32).copy()
        rb.unmap()
        return out

    pool = ThreadPoolExecutor(max(THREADS))

    def threaded(dst_bytes: np.ndarray, threads: int) -> None:
        raw = src.view(np.uint8)
        step = -(-n // threads // 4096) * 4096  # (page-aligned slices)
        for f in [pool.submit(np.copyto, dst_bytes[i:i + step], raw[i:i + step]) for i in range(0, n, step)]:
            f.result()

    variants = {"one write": lambda: write(n), "numpy copy": lambda: np.copyto(host, src), "read back": read_back}
    for t in THREADS:
        variants[f"numpy copy, {t} threads"] = lambda t=t: threaded(host.view(np.uint8), t)
    if ctx.host_memory:
        from paged_sparse_attn.backends.wgpu._host_io import InputBlock, PinnedAccount

        pin = InputBlock(ctx, n, [], PinnedAccount(n))

        def pinned(threads: int = 1):
            if threads == 1:
                pin.write(src)
            else:
                threaded(pin.bytes, threads)
            enc = dev.create_command_encoder()
            enc.copy_buffer_to_buffer(pin.buffer, 0, dst, 0, n)
            dev.queue.submit([enc.finish()])
            wait_queue_spinning(ctx)

        variants["pinned copy"] = pinned
        for t in THREADS:
            variants[f"pinned copy, {t} threads"] = lambda t=t: pinned(t)
    for mib in (16, 4, 1):
        if (mib << 20) < n:
            variants[f"chunks of {mib} MiB"] = lambda c=mib << 20: write(c)
    times: dict = {k: [] for k in variants}
    for r in range(a.repeat + 1):
        for name, f in variants.items():
            t = time.perf_counter()
            f()
            if r:
                times[name].append(time.perf_counter() - t)
    if not np.array_equal(host, src):
        raise SystemExit("a threaded copy lost bytes")
    back = np.frombuffer(dev.queue.read_buffer(dst, 0, n), dtype=np.float32)
    print(f"{ctx.summary} ({ctx.runtime.name}): {a.mib} MiB, median of {a.repeat} (ms, GB/s); "
          f"device copy equals the source: {bool(np.array_equal(back, src))}", flush=True)
    for name, ts in times.items():
        m = float(np.median(ts))
        print(f"  {name:20s} {m * 1e3:8.2f} ms  {n / m / 1e9:6.1f} GB/s  rounds {[round(x * 1e3, 2) for x in ts]}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
