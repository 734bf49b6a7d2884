"""What a decode attention layer costs when the host is not what the loop waits for: the plan's
``run`` against the same commands replayed with little Python.

Usage: ``python scripts/experiment_host_floor.py [wgpu] [dawn]`` (``ROUNDS=N``, default 8;
``QUICK=1``: a small problem for a CPU driver). The layer suite's decode workload, 32 layers of
device arrays per loop, one sync at the end; per mode the median (and min) host microseconds per
layer until the last call returned, and the wall time per layer:

* ``plan.run``: what a user runs;
* ``wgpu-py replay``: the dispatches ``plan.run`` records (captured from one call), encoded with
  wgpu-py's encoder, the clear of the error words before the pass and their copy after it;
* ``C replay``: the same commands through the runtime's C functions only;
* ``C no clear/copy``: without the clear and the copy;
* ``C per K``: K layers recorded into one command encoder, one finish and submit per K.

H200 output: ``docs/benchmarks-data/h200-host-floor-2026-12-02.txt``.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _layer_inputs import layer_inputs, on_device, timed_loops

from paged_sparse_attn import registry


def main(name, lw, prob):
    d = on_device(registry.get_backend(name), lw, prob)
    be, plan, kd, vd, qd, sd = d.be, d.plan, d.k, d.v, d.q, d.sel
    rt = plan._runtime
    trip = []
    orig = rt._dispatch
    rt._dispatch = lambda cp, p, b, g: (trip.append((p, b, g)), orig(cp, p, b, g))
    out = plan.run(qd[0], kd, vd, sd); out.numpy()
    rt._dispatch = orig
    print(name, "dispatches per layer:", len(trip), [g for _, _, g in trip])
    dev = be.device_context.device
    queue = dev.queue
    res = rt._result_buffer()
    args = rt.args
    rec = rt.rec
    mod = importlib.import_module(be.device_context.runtime.c_module)
    lib, ffi = mod.lib, mod.ffi
    d_enc = ffi.new("WGPUCommandEncoderDescriptor *")
    d_pass = ffi.new("WGPUComputePassDescriptor *")
    d_cb = ffi.new("WGPUCommandBufferDescriptor *")
    cbs = ffi.new("WGPUCommandBuffer[1]")
    hdev, hq, hargs, hres = dev._internal, queue._internal, args._internal, res._internal
    tr_c = [(p._internal, b._internal, g[0], g[1]) for p, b, g in trip]
    sp, sb, dw = lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup, lib.wgpuComputePassEncoderDispatchWorkgroups
    NULL = ffi.NULL
    errw = rt.o_bytes + rt.ml_bytes

    def py_layer(i):
        enc = dev.create_command_encoder()
        enc.clear_buffer(args, 48, 16)
        cp = enc.begin_compute_pass()
        for p, b, g in trip:
            rec.dispatch3(cp, p, b, g[0], g[1])
        cp.end()
        enc.copy_buffer_to_buffer(args, 48, res, errw, 8)
        queue.submit([enc.finish()])

    def c_multi(K, extras=True):
        """K layers per command encoder through the C functions (with or without the clear and
        the copy around each layer's pass)."""
        st = {"enc": None, "n": 0}

        def f(i):
            if st["enc"] is None:
                st["enc"] = lib.wgpuDeviceCreateCommandEncoder(hdev, d_enc)
            enc = st["enc"]
            if extras:
                lib.wgpuCommandEncoderClearBuffer(enc, hargs, 48, 16)
            cp = lib.wgpuCommandEncoderBeginComputePass(enc, d_pass)
            for p, b, x, y in tr_c:
                sp(cp, p); sb(cp, 0, b, 0, NULL); dw(cp, x, y, 1)
            lib.wgpuComputePassEncoderEnd(cp)
            lib.wgpuComputePassEncoderRelease(cp)
            if extras:
                lib.wgpuCommandEncoderCopyBufferToBuffer(enc, hargs, 48, hres, errw, 8)
            st["n"] += 1
            if st["n"] == K or i == 31:
                cb = lib.wgpuCommandEncoderFinish(enc, d_cb)
                cbs[0] = cb
                lib.wgpuQueueSubmit(hq, 1, cbs)
                lib.wgpuCommandBufferRelease(cb)
                lib.wgpuCommandEncoderRelease(enc)
                st["enc"], st["n"] = None, 0
        return f

    def plan_layer(i):
        plan.run(qd[i], kd, vd, sd)

    modes = {"plan.run": plan_layer, "wgpu-py replay": py_layer, "C replay": c_multi(1),
             "C no clear/copy": c_multi(1, False), "C per 2": c_multi(2), "C per 4": c_multi(4),
             "C per 8": c_multi(8), "C per 32": c_multi(32), "C per 4 no clr": c_multi(4, False)}
    for m, a in timed_loops(modes, be.synchronize, int(os.environ.get("ROUNDS", "8"))).items():
        print(f"{name} {m:16s}: host {np.median(a[:, 1]):6.1f} us/layer (min {a[:, 1].min():.1f}), "
              f"wall {np.median(a[:, 0]):6.1f} (min {a[:, 0].min():.1f})", flush=True)
    plan.close()


if __name__ == "__main__":
    lw, prob, _, _ = layer_inputs("decode", (1, 256) if os.environ.get("QUICK") else None)
    for name in sys.argv[1:] or ["wgpu", "dawn"]:
        main(name, lw, prob)
