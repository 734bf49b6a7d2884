"""float16 queries widened on the device (R7, ``psa_widen.wgsl``): every float16 value becomes the
float32 numpy's ``astype`` gives, bit for bit (NaN payloads, signed zeros and subnormals
included); the planned paths' results with a float16 q are checked by the kit
(``test_R7_a_float16_q_gives_the_bits_of_q_widened_by_numpy``)."""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends.wgpu._layer import WIDEN, WIDEN_WG, _grid
from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage


@pytest.mark.psa_backends(exclude=("numpy",))
def test_R7_the_widening_kernel_gives_numpys_bits_for_every_float16_value(backend):
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)  # every bit pattern, in order
    ctx = backend.device_context
    n2 = halves.size // 2
    grid = _grid(-(-n2 // WIDEN_WG), 64)  # several rows of workgroups: the kernel's row stride is tested too
    pipe, bgl = backend._pipeline(WIDEN, False, {"N2": n2, "WG": WIDEN_WG, "GX": grid[0]})
    dev = ctx.device
    src = dev.create_buffer_with_data(data=halves, usage=BufferUsage.STORAGE)
    dst = dev.create_buffer(size=4 * halves.size + 64, usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC
                            | BufferUsage.COPY_DST)
    dev.queue.write_buffer(dst, 0, np.full(halves.size + 16, 0x7fc0dead, np.uint32))  # nothing stale passes
    bg = dev.create_bind_group(layout=bgl, entries=[{"binding": 0, "resource": {"buffer": src}},
                                                    {"binding": 1, "resource": {"buffer": dst}}])
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, bg)
    cp.dispatch_workgroups(grid[0], grid[1], 1)
    cp.end()
    dev.queue.submit([enc.finish()])
    got = np.frombuffer(dev.queue.read_buffer(dst), np.uint32)
    want = halves.view(np.float16).astype(np.float32).view(np.uint32)
    bad = np.flatnonzero(got[:halves.size] != want)
    assert bad.size == 0, (f"R7: {bad.size} float16 values widened wrongly, first 0x{int(halves[bad[0]]):04x}: "
                           f"0x{int(got[bad[0]]):08x} instead of 0x{int(want[bad[0]]):08x}")
    assert (got[halves.size:] == 0x7fc0dead).all(), "the kernel wrote past N2 words"
    for b in (src, dst):
        b.destroy()


@pytest.mark.psa_backends(exclude=("numpy",))
def test_R7_a_device_resident_float16_q_gives_the_bits_of_the_float32_call(backend):
    rng = np.random.default_rng(3)
    P, Hkv, S, D, B = 4, 1, 4, 8, 2
    k = rng.standard_normal((P, Hkv, S, D)).astype(np.float16)
    kd, vd = backend.upload_kv_cache(k, k)
    bt = np.arange(P, dtype=np.int32).reshape(B, 2)
    cu = np.arange(B + 1, dtype=np.int32)
    lens = np.full(B, 8, np.int32)
    plan = psa.plan_attention(bt, cu, lens, block_size=4, page_size=S, num_q_heads=2, num_kv_heads=Hkv,
                              head_dim=D, kv_dtype="float16", topk=1, backend=backend)
    q = rng.standard_normal((B, 2, D)).astype(np.float16)
    sel = np.zeros((B, Hkv, 1), np.int32)
    want = plan.run(q.astype(np.float32), kd, vd, sel, return_lse=True)
    got = plan.run(backend.asarray(q), kd, vd, backend.asarray(sel), return_lse=True)
    assert all(a.tobytes() == b.numpy().tobytes() for a, b in zip(want, got))
    plan.close()
