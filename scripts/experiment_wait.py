"""Experiment: how soon a thread that waits for a dispatch of ~100 us wakes, on Dawn: blocking
(``on_submitted_work_done_sync``) against polling (``wgpuInstanceProcessEvents`` in a loop, or
``wgpuInstanceWaitAny`` with a zero timeout, as ``Runtime.poll_work_done`` does). Wall time of a
submission and its wait, median and 90th percentile of 300, three rounds; the argument is the
kernel's loop length (1: an empty dispatch). Run on a machine with a GPU Dawn supports:

    python scripts/experiment_wait.py 20000
"""

from __future__ import annotations

import sys
import time

import numpy as np

from paged_sparse_attn.backends.wgpu._runtime import DAWN

LOOP = """@group(0) @binding(0) var<storage, read_write> b: array<f32>;
@compute @workgroup_size(256) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    var x = b[g.x];
    for (var i = 0u; i < ITERS; i++) {
        x = x * 1.0000001 + 0.5;
    }
    b[g.x] = x;
}"""


def main() -> int:
    iters = sys.argv[1] if len(sys.argv) > 1 else "20000"
    gpu = DAWN.gpu()
    from wgpudawn.backends.dawn import _api  # (the wgpudawn 0.32 the extra pins)

    dev = gpu.gpu.request_adapter_sync(power_preference="high-performance").request_device_sync()
    pipe = dev.create_compute_pipeline(layout="auto", compute={
        "module": dev.create_shader_module(code=LOOP.replace("ITERS", f"{int(iters)}u")), "entry_point": "main"})
    buf = dev.create_buffer(size=4 * 256 * 132 * 4, usage=gpu.BufferUsage.STORAGE)
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": buf}}])

    def submit():
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(132 * 4)
        cp.end()
        dev.queue.submit([enc.finish()])

    def w_block():
        dev.queue.on_submitted_work_done_sync()

    def w_spin_events():
        pr = dev.queue.on_submitted_work_done_async()
        while pr._state == "pending":
            _api.process_events()

    def w_spin_waitany():
        pr = dev.queue.on_submitted_work_done_async()
        info = _api.ffi.new("WGPUFutureWaitInfo *")
        info.future.id = pr._wgpu_future_id
        instance = _api.get_wgpu_instance()
        while not info.completed:
            _api.libf.wgpuInstanceWaitAny(instance, 1, info, 0)
        pr.sync_wait()

    def run(wait, n=300):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            submit()
            wait()
            ts.append(time.perf_counter() - t)
        return np.median(ts) * 1e6, np.percentile(ts, 90) * 1e6

    run(w_block, 50)  # (warm-up)
    for _ in range(3):
        for wait in (w_block, w_spin_events, w_spin_waitany):
            m, p90 = run(wait)
            print(f"{wait.__name__:16s} median {m:7.1f} p90 {p90:7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
