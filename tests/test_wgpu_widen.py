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
    # every bit pattern, in order, and one more: an odd count (the last word's high half unused)
    halves = np.append(np.arange(65536, dtype=np.uint32).astype(np.uint16), np.uint16(0x3c00))
    ctx = backend.device_context
    n2 = (halves.size + 1) // 2
    grid = _grid(-(-n2 // WIDEN_WG), 64)  # several rows of workgroups: the kernel's row stride is tested too
    pipe, bgl = backend._pipeline(WIDEN, False, {"N": halves.size, "WG": WIDEN_WG, "GX": grid[0]})
    dev = ctx.device
    src = dev.create_buffer_with_data(data=np.append(halves, np.uint16(0x7bff)), usage=BufferUsage.STORAGE)
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
    assert (got[halves.size:] == 0x7fc0dead).all(), "the kernel wrote past its N values"
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
    got = plan.run(backend.asarray(q), kd, vd, backend.asarray(sel), return_lse=True)  # first: nothing stale
    want = plan.run(q.astype(np.float32), kd, vd, sel, return_lse=True)
    assert all(a.tobytes() == b.numpy().tobytes() for a, b in zip(want, got))
    plan.close()


@pytest.mark.psa_backends(exclude=("numpy",))
@pytest.mark.parametrize("d_idx", [8, 6])  # rows of whole 16-byte units (widened on the device), and not
def test_R7_a_float16_index_q_gives_the_bits_of_the_float32_layer(backend, d_idx):
    rng = np.random.default_rng(5)
    P, Hkv, S, D, B, G = 8, 2, 4, 8, 2, 2
    k = rng.standard_normal((P, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((P, Hkv, S, D)).astype(np.float32)
    ik = rng.standard_normal((P, 1, S, d_idx)).astype(np.float32)
    kd, vd = backend.upload_kv_cache(k, v)
    ikd = backend.upload_index_cache(ik)
    bt = np.arange(P, dtype=np.int32).reshape(B, 4)
    cu = np.array([0, 1, 3], np.int32)
    lens = np.array([16, 13], np.int32)
    q = rng.standard_normal((3, Hkv * G, D)).astype(np.float32)
    iq16 = rng.standard_normal((3, Hkv, d_idx)).astype(np.float16)
    iq16.reshape(-1)[::5] = np.float16(3e-6)  # subnormal halves among them

    def make_plan():
        return psa.plan_attention(bt, cu, lens, block_size=4, page_size=S, num_q_heads=Hkv * G, num_kv_heads=Hkv,
                                  head_dim=D, kv_dtype="float32", topk=2, causal=True, index_dim=d_idx,
                                  num_index_heads=1, index_dtype="float32", backend=backend)

    plan = make_plan()
    got = plan.run_sparse(q, kd, vd, iq16, ikd, return_lse=True)  # first: no float32 index_q left in place
    want = plan.run_sparse(q, kd, vd, iq16.astype(np.float32), ikd, return_lse=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(want, got)), "R7: run_sparse() with a float16 index_q"
    sa = psa.sparse_attention(q, kd, vd, iq16, ikd, bt, cu, used_kv_lens=lens, block_size=4, topk=2,
                              backend=backend, return_lse=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(want, sa)), "R7: sparse_attention() with a float16 index_q"
    plan.close()
    if d_idx % 4 == 0:  # a device-resident float16 index_q: bound and widened where it is (a fresh plan)
        plan = make_plan()
        dev = plan.run_sparse(backend.asarray(q), kd, vd, backend.asarray(iq16), ikd, return_lse=True)
        assert all(a.tobytes() == b.numpy().tobytes() for a, b in zip(want, dev)), \
            "R7: run_sparse() with a device-resident float16 index_q"
        plan.close()
