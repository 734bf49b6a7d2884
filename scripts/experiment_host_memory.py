"""Experiment: buffers over host memory on Dawn (feature ``host-mapped-pointer``) against
``write_buffer`` and a mapped readback: 512 KiB up and back, by copies and by a kernel that reads
a device buffer and writes its results into host memory; wall time per round trip, median of
200. Run on a machine with a GPU Dawn supports:

    python scripts/experiment_host_memory.py
"""

import time

import numpy as np

from paged_sparse_attn.backends.wgpu._runtime import DAWN
gpu = DAWN.gpu()
from wgpudawn.backends.dawn import extras, _extras_memory as xm
ad = gpu.gpu.request_adapter_sync(power_preference="high-performance")
feats = sorted(map(str, ad.features)); print("adapter:", ad.summary)
print("host-mapped-pointer" in feats, "buffer-map-extended-usages" in feats, [f for f in feats if "map" in f or "host" in f])
dev = ad.request_device_sync(required_features=[f for f in ("host-mapped-pointer","buffer-map-extended-usages") if f in feats])
BU = gpu.BufferUsage
N = 512*1024
q = np.random.default_rng(0).standard_normal(N//4).astype(np.float32)
D = dev.create_buffer(size=N, usage=BU.STORAGE|BU.COPY_DST|BU.COPY_SRC)
RB = dev.create_buffer(size=N, usage=BU.MAP_READ|BU.COPY_DST)
def med(f, n=200):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e6
def base():
    dev.queue.write_buffer(D, 0, q)
    enc = dev.create_command_encoder(); enc.copy_buffer_to_buffer(D,0,RB,0,N); dev.queue.submit([enc.finish()])
    RB.map_sync(gpu.MapMode.READ, 0, N); out = np.frombuffer(RB.read_mapped(0,N,copy=False), np.float32).copy(); RB.unmap()
    return out
assert np.array_equal(base(), q)
print("base write+copy+map+read us", med(base))
print("write_buffer alone us", med(lambda: dev.queue.write_buffer(D, 0, q)))
dev.queue.on_submitted_work_done_sync()
print("work_done idle us", med(lambda: dev.queue.on_submitted_work_done_sync()))
print("np copy 512K fresh us", med(lambda: q.copy()))
pre = np.empty_like(q)
print("np copyto prefaulted us", med(lambda: np.copyto(pre, q)))
if "host-mapped-pointer" in feats:
    mi = xm.allocate_host_memory(dev, N); mo = xm.allocate_host_memory(dev, N)
    hi = np.frombuffer(mi, np.float32); ho = np.frombuffer(mo, np.float32)
    HI = xm.create_buffer_from_host_memory(dev, mi, usage=BU.COPY_SRC|BU.STORAGE)
    try:
        HO = xm.create_buffer_from_host_memory(dev, mo, usage=BU.COPY_DST|BU.STORAGE)
    except Exception as e:
        print("HO storage failed", e); HO = xm.create_buffer_from_host_memory(dev, mo, usage=BU.COPY_DST)
    def host():
        np.copyto(hi, q)
        enc = dev.create_command_encoder(); enc.copy_buffer_to_buffer(HI,0,D,0,N); enc.copy_buffer_to_buffer(D,0,HO,0,N)
        dev.queue.submit([enc.finish()]); dev.queue.on_submitted_work_done_sync()
        return ho.copy()
    r = host(); print("host ok", np.array_equal(r, q))
    print("host copyto+2copies+wait+read us", med(host))
    print("copyto host mem us", med(lambda: np.copyto(hi, q)))
    print("read host mem us", med(lambda: ho.copy()))
    # a shader writing to host memory
    sm = dev.create_shader_module(code="@group(0) @binding(0) var<storage, read> a: array<f32>; @group(0) @binding(1) var<storage, read_write> b: array<f32>; @compute @workgroup_size(256) fn main(@builtin(global_invocation_id) g: vec3<u32>) { let i = g.x + g.y * 65535u * 256u; if (i < arrayLength(&a)) { b[i] = a[i] * 2.0; } }")
    p = dev.create_compute_pipeline(layout="auto", compute={"module": sm, "entry_point": "main"})
    try:
        bg = dev.create_bind_group(layout=p.get_bind_group_layout(0), entries=[{"binding":0,"resource":{"buffer":D}},{"binding":1,"resource":{"buffer":HO}}])
        def kern():
            dev.queue.write_buffer(D, 0, q)
            enc = dev.create_command_encoder(); cp = enc.begin_compute_pass(); cp.set_pipeline(p); cp.set_bind_group(0,bg); cp.dispatch_workgroups(N//4//256); cp.end()
            dev.queue.submit([enc.finish()]); dev.queue.on_submitted_work_done_sync(); return ho.copy()
        print("kernel->host ok", np.array_equal(kern(), q*2), "us", med(kern))
        bg2 = dev.create_bind_group(layout=p.get_bind_group_layout(0), entries=[{"binding":0,"resource":{"buffer":D}},{"binding":1,"resource":{"buffer":D}}]) if False else None
        RB2 = dev.create_buffer(size=N, usage=BU.STORAGE|BU.COPY_SRC)
        bg3 = dev.create_bind_group(layout=p.get_bind_group_layout(0), entries=[{"binding":0,"resource":{"buffer":D}},{"binding":1,"resource":{"buffer":RB2}}])
        def kern_base():
            dev.queue.write_buffer(D, 0, q)
            enc = dev.create_command_encoder(); cp = enc.begin_compute_pass(); cp.set_pipeline(p); cp.set_bind_group(0,bg3); cp.dispatch_workgroups(N//4//256); cp.end()
            enc.copy_buffer_to_buffer(RB2,0,RB,0,N)
            dev.queue.submit([enc.finish()]); RB.map_sync(gpu.MapMode.READ, 0, N); out = np.frombuffer(RB.read_mapped(0,N,copy=False), np.float32).copy(); RB.unmap(); return out
        print("kernel->map ok", np.array_equal(kern_base(), q*2), "us", med(kern_base))
        def kern_hostin():
            np.copyto(hi, q)
            enc = dev.create_command_encoder(); enc.copy_buffer_to_buffer(HI,0,D,0,N); cp = enc.begin_compute_pass(); cp.set_pipeline(p); cp.set_bind_group(0,bg); cp.dispatch_workgroups(N//4//256); cp.end()
            dev.queue.submit([enc.finish()]); dev.queue.on_submitted_work_done_sync(); return ho.copy()
        print("hostin kernel->host ok", np.array_equal(kern_hostin(), q*2), "us", med(kern_hostin))
        for k,f in (("base",kern_base),("host",kern_hostin)):
            print(k, "again", med(f))
    except Exception as e:
        print("storage on host buffer failed:", e)
