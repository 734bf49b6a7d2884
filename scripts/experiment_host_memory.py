"""Experiment: buffers over host memory on Dawn (feature ``host-mapped-pointer``) against
``write_buffer`` and a mapped readback: 512 KiB up and back, by copies and by a kernel that reads
a device buffer and writes its results into host memory; wall time per round trip, median of
200. Prints the adapter's mapping features first. Run on a machine with a GPU Dawn supports:

    python scripts/experiment_host_memory.py
"""

from __future__ import annotations

import time

import numpy as np

from paged_sparse_attn.backends.wgpu._runtime import DAWN

N = 512 * 1024  # bytes up and back
DOUBLE = """@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> b: array<f32>;
@compute @workgroup_size(256) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    let i = g.x + g.y * 65535u * 256u;
    if (i < arrayLength(&a)) {
        b[i] = a[i] * 2.0;
    }
}"""


def med(f, n: int = 200) -> float:
    """Median wall microseconds of ``n`` calls of ``f``."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def main() -> int:
    gpu = DAWN.gpu()
    from wgpudawn.backends.dawn import _extras_memory as xm

    ad = gpu.gpu.request_adapter_sync(power_preference="high-performance")
    feats = sorted(map(str, ad.features))
    print("adapter:", ad.summary)
    print("host-mapped-pointer" in feats, "buffer-map-extended-usages" in feats,
          [f for f in feats if "map" in f or "host" in f])
    dev = ad.request_device_sync(required_features=[f for f in ("host-mapped-pointer", "buffer-map-extended-usages")
                                                    if f in feats])
    U = gpu.BufferUsage
    q = np.random.default_rng(0).standard_normal(N // 4).astype(np.float32)
    dbuf = dev.create_buffer(size=N, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)
    rb = dev.create_buffer(size=N, usage=U.MAP_READ | U.COPY_DST)

    def mapped_copy():
        rb.map_sync(gpu.MapMode.READ, 0, N)
        out = np.frombuffer(rb.read_mapped(0, N, copy=False), np.float32).copy()
        rb.unmap()
        return out

    def base():  # write_buffer, a copy into the readback buffer, a map
        dev.queue.write_buffer(dbuf, 0, q)
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(dbuf, 0, rb, 0, N)
        dev.queue.submit([enc.finish()])
        return mapped_copy()

    assert np.array_equal(base(), q)
    print("base write+copy+map+read us", med(base))
    print("write_buffer alone us", med(lambda: dev.queue.write_buffer(dbuf, 0, q)))
    dev.queue.on_submitted_work_done_sync()
    print("work_done idle us", med(lambda: dev.queue.on_submitted_work_done_sync()))
    print("np copy 512K fresh us", med(lambda: q.copy()))
    pre = np.empty_like(q)
    print("np copyto prefaulted us", med(lambda: np.copyto(pre, q)))
    if "host-mapped-pointer" not in feats:
        return 0
    mi, mo = xm.allocate_host_memory(dev, N), xm.allocate_host_memory(dev, N)
    hi, ho = np.frombuffer(mi, np.float32), np.frombuffer(mo, np.float32)
    hbuf_in = xm.create_buffer_from_host_memory(dev, mi, usage=U.COPY_SRC | U.STORAGE)
    hbuf_out = xm.create_buffer_from_host_memory(dev, mo, usage=U.COPY_DST | U.STORAGE)

    def host():  # numpy into host memory, two copies, a wait on the queue, numpy out
        np.copyto(hi, q)
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(hbuf_in, 0, dbuf, 0, N)
        enc.copy_buffer_to_buffer(dbuf, 0, hbuf_out, 0, N)
        dev.queue.submit([enc.finish()])
        dev.queue.on_submitted_work_done_sync()
        return ho.copy()

    print("host ok", np.array_equal(host(), q))
    print("host copyto+2copies+wait+read us", med(host))
    print("copyto host mem us", med(lambda: np.copyto(hi, q)))
    print("read host mem us", med(lambda: ho.copy()))
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": dev.create_shader_module(code=DOUBLE),
                                                               "entry_point": "main"})
    dres = dev.create_buffer(size=N, usage=U.STORAGE | U.COPY_SRC)

    def group(dst):
        return dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": 0, "resource": {"buffer": dbuf}}, {"binding": 1, "resource": {"buffer": dst}}])

    to_host, to_device = group(hbuf_out), group(dres)

    def dispatch(enc, bg):
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(N // 4 // 256)
        cp.end()

    def kern():  # write_buffer in, the kernel writes into host memory, a wait on the queue
        dev.queue.write_buffer(dbuf, 0, q)
        enc = dev.create_command_encoder()
        dispatch(enc, to_host)
        dev.queue.submit([enc.finish()])
        dev.queue.on_submitted_work_done_sync()
        return ho.copy()

    def kern_base():  # write_buffer in, the kernel into a device buffer, copied out and mapped
        dev.queue.write_buffer(dbuf, 0, q)
        enc = dev.create_command_encoder()
        dispatch(enc, to_device)
        enc.copy_buffer_to_buffer(dres, 0, rb, 0, N)
        dev.queue.submit([enc.finish()])
        return mapped_copy()

    def kern_hostin():  # host memory in and out
        np.copyto(hi, q)
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(hbuf_in, 0, dbuf, 0, N)
        dispatch(enc, to_host)
        dev.queue.submit([enc.finish()])
        dev.queue.on_submitted_work_done_sync()
        return ho.copy()

    print("kernel->host ok", np.array_equal(kern(), q * 2), "us", med(kern))
    print("kernel->map ok", np.array_equal(kern_base(), q * 2), "us", med(kern_base))
    print("hostin kernel->host ok", np.array_equal(kern_hostin(), q * 2), "us", med(kern_hostin))
    for label, f in (("base", kern_base), ("host", kern_hostin)):
        print(label, "again", med(f))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
