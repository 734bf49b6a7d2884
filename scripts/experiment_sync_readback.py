"""Where the time of a readback goes, and what a wait without a copy costs (H200 data:
docs/benchmarks-data/h200-readback-2026-12-02.txt).

For each runtime (``wgpu``, ``dawn``; argv picks): a buffer copied back at three sizes (the map's
wait, the copy out of the mapped buffer, ``queue.read_buffer``, an upload with a wait, a host
memcpy of the same bytes); an idle wait by a mapped 4-byte copy and by
``on_submitted_work_done_sync``; then the layer suite's decode and prefill attention loops ended
by ``out.numpy()`` or by either wait, one ``out.numpy()`` after a wait, ``forward()`` with host
arrays and its stage times (decode: a cProfile of 200 calls). torch's ``.cpu()`` and a copy
into pinned memory first, where torch is importable. ``SHAPE=TQ,L`` shrinks the prefill for a
CPU driver.
"""
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import functools

from _layer_inputs import layer_inputs as _li

layer_inputs = functools.lru_cache(None)(_li)
from paged_sparse_attn import forward, registry
from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage
from paged_sparse_attn.bench.layer import _plan


def med(x): return float(np.median(x))

def raw(name):
    be = registry.get_backend(name)
    dev = be._device().device
    for n in (512 * 1024 + 16384, 8 << 20, 64 << 20):
        src = dev.create_buffer(size=n, usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC | BufferUsage.COPY_DST)
        rb = dev.create_buffer(size=n, usage=BufferUsage.MAP_READ | BufferUsage.COPY_DST)
        host = np.ones(n, np.uint8)
        w, c, rbt, wr, hc = [], [], [], [], []
        for i in range(6):
            t0 = time.perf_counter()
            dev.queue.write_buffer(src, 0, host)
            dev.queue.read_buffer(src, 0, 4)
            wr.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            enc = dev.create_command_encoder(); enc.copy_buffer_to_buffer(src, 0, rb, 0, n)
            dev.queue.submit([enc.finish()])
            t1 = time.perf_counter()
            rb.map_sync("READ_NOSYNC", 0, n)
            t2 = time.perf_counter()
            np.frombuffer(rb.read_mapped(0, n, copy=False), np.uint8).copy()
            t3 = time.perf_counter()
            rb.unmap()
            w.append(t2 - t1); c.append(t3 - t2)
            t0 = time.perf_counter(); dev.queue.read_buffer(src, 0, n); rbt.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); host.copy(); hc.append(time.perf_counter() - t0)
        print(f"{name} {n/2**20:7.2f} MiB: map wait {med(w)*1e6:8.1f} us  copy from mapped {med(c)*1e6:8.1f} us "
              f"({n/med(c)/1e9:5.2f} GB/s)  queue.read_buffer {med(rbt)*1e6:8.1f} us ({n/med(rbt)/1e9:5.2f} GB/s)  "
              f"write+wait {med(wr)*1e6:8.1f} us ({n/med(wr)/1e9:5.2f} GB/s)  host memcpy {med(hc)*1e6:7.1f} us", flush=True)
        src.destroy(); rb.destroy()
    # a wait without a copy
    buf = dev.create_buffer(size=16, usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC)
    for how in ("read4", "done"):
        ts = []
        for i in range(20):
            enc = dev.create_command_encoder(); dev.queue.submit([enc.finish()])
            t0 = time.perf_counter()
            try:
                if how == "read4":
                    dev.queue.read_buffer(buf, 0, 4)
                else:
                    dev.queue.on_submitted_work_done_sync()
            except Exception as e:  # noqa: BLE001 -- a probe reports what failed and goes on
                print(name, how, "fails:", type(e).__name__, e); break
            ts.append(time.perf_counter() - t0)
        if ts:
            print(f"{name} idle wait via {how}: {med(ts)*1e6:.1f} us", flush=True)
    return be

def loops(name, be, workload):
    sh = tuple(int(x) for x in os.environ["SHAPE"].split(",")) if os.environ.get("SHAPE") else None
    lw, prob, _, _ = layer_inputs(workload, sh if workload == "prefill" else None)
    kd, vd = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
    plan = _plan(be, lw, prob)
    rng = np.random.default_rng(2)
    qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(lw.layers)]
    qd = [be.asarray(q) for q in qs]
    sd = be.asarray(prob["selected"])
    dev = be._device().device
    small = dev.create_buffer(size=16, usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC)
    syncs = {"numpy": lambda r: r.numpy(),
             "read4": lambda r: dev.queue.read_buffer(small, 0, 4),
             "done": lambda r: dev.queue.on_submitted_work_done_sync()}
    for sname, sync in syncs.items():
        per = []
        try:
            for rep in range(4):
                t0 = time.perf_counter()
                for i in range(lw.layers):
                    r = plan.run(qd[i], kd, vd, sd)
                t1 = time.perf_counter()
                sync(r)
                t2 = time.perf_counter()
                if rep:
                    per.append(((t2 - t0) / lw.layers, (t1 - t0) / lw.layers, t2 - t1))
        except Exception as e:  # noqa: BLE001 -- a probe reports what failed and goes on
            print(name, workload, sname, "fails", type(e).__name__, e); continue
        p = np.median(np.array(per), axis=0)
        print(f"{name} {workload} attention loop, sync={sname:6s}: {p[0]*1e6:9.1f} us/layer (host {p[1]*1e6:8.1f}), final sync {p[2]*1e6:9.1f} us", flush=True)
    r = plan.run(qd[0], kd, vd, sd)
    sync = syncs["read4"]; sync(r)
    t0 = time.perf_counter(); r.numpy(); t1 = time.perf_counter()
    print(f"{name} {workload} out.numpy() after a wait: {(t1-t0)*1e6:.1f} us ({r.nbytes/2**20:.2f} MiB)", flush=True)
    # forward() with host arrays
    fargs = dict(used_kv_lens=prob["used_kv_lens"], block_size=lw.w.block_size, causal=lw.w.causal, backend=be)
    call = lambda i: forward(qs[i % lw.layers], kd, vd, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"], **fargs)
    n = 30 if workload == "decode" else 4
    tt, lt = [], []
    for i in range(n):
        t0 = time.perf_counter(); call(i); tt.append(time.perf_counter() - t0); lt.append(dict(be.last_timings))
    keys = [k for k in lt[-1] if k.endswith("_s")]
    print(f"{name} {workload} forward(): {med(tt[1:])*1e6:.1f} us; " + "  ".join(
        f"{k} {med([d.get(k, np.nan) for d in lt[1:]])*1e6:.1f}" for k in keys), flush=True)
    if workload == "decode":
        pr = cProfile.Profile(); pr.enable()
        for i in range(200): call(i)
        pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue()[:6000])
    plan.close(); kd.release(); vd.release()

def torch_part():
    import torch
    for n in (512 * 1024 + 16384, 64 << 20):
        x = torch.ones(n, dtype=torch.uint8, device="cuda")
        pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        a, b = [], []
        for i in range(6):
            torch.cuda.synchronize(); t0 = time.perf_counter(); x.cpu(); a.append(time.perf_counter() - t0)
            torch.cuda.synchronize(); t0 = time.perf_counter(); pin.copy_(x); torch.cuda.synchronize(); b.append(time.perf_counter() - t0)
        print(f"torch {n/2**20:7.2f} MiB: .cpu() {med(a)*1e6:8.1f} us ({n/med(a)/1e9:5.2f} GB/s); to pinned {med(b)*1e6:8.1f} us ({n/med(b)/1e9:5.2f} GB/s)", flush=True)

if __name__ == "__main__":
    which = sys.argv[1:] or ["wgpu", "dawn"]
    try:
        torch_part()
    except Exception as e:  # noqa: BLE001 -- a probe reports what failed and goes on
        print("torch:", e)
    for name in which:
        be = raw(name)
        for wl in ("decode", "prefill"):
            loops(name, be, wl)
