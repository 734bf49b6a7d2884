"""Dispatches recorded through the runtimes' C functions (``_record.py``): an invalid one still
raises (from the encoder's finish), and a plan's results are the same bits either way."""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends.wgpu._record import recorder

WRITE_ONE = ("@group(0) @binding(0) var<storage, read_write> a: array<u32>;\n"
             "@compute @workgroup_size(1) fn main() { a[0] = 1u; }")
WRITE_U = ("@group(0) @binding(0) var<uniform> u: vec4<u32>;\n"
           "@group(0) @binding(1) var<storage, read_write> a: array<u32>;\n"
           "@compute @workgroup_size(1) fn main() { a[0] = u.x; }")


def _record_mismatched_dispatch(device, runtime):
    """Record, through the C functions, a dispatch whose bind group does not fit the pipeline;
    return the encoder (its finish must raise)."""
    gpu = runtime.gpu()
    U = gpu.BufferUsage

    def pipe(code):
        return device.create_compute_pipeline(layout="auto", compute={
            "module": device.create_shader_module(code=code), "entry_point": "main"})

    p1, p2 = pipe(WRITE_ONE), pipe(WRITE_U)
    buf = device.create_buffer(size=64, usage=U.STORAGE)
    ub = device.create_buffer(size=16, usage=U.UNIFORM)
    wrong = device.create_bind_group(layout=p2.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": ub}}, {"binding": 1, "resource": {"buffer": buf}}])
    enc = device.create_command_encoder()
    cp = enc.begin_compute_pass()
    recorder(runtime).dispatch3(cp, p1, wrong, 1, 1)  # p1's group 0 is one storage buffer
    cp.end()
    return enc


def test_an_invalid_dispatch_recorded_through_c_raises_at_finish_on_wgpu_native(WgpuBackend):
    be = WgpuBackend()
    ctx = be.device_context
    assert recorder(ctx.runtime) is not None, "wgpu-native's layers record through its C functions"
    enc = _record_mismatched_dispatch(ctx.device, ctx.runtime)
    gpu = ctx.runtime.gpu()
    with pytest.raises(gpu.GPUValidationError, match="(?i)bind ?group"):
        enc.finish()


def test_an_invalid_dispatch_recorded_through_c_raises_at_finish_on_dawn(dawn_runtime):
    """Dawn's Null adapter validates every command and runs nothing: enough for this check."""
    device = dawn_runtime.null_adapter().request_device_sync()
    enc = _record_mismatched_dispatch(device, dawn_runtime)
    gpu = dawn_runtime.gpu()
    with pytest.raises(gpu.GPUValidationError):
        enc.finish()


@pytest.mark.parametrize("sparse", [False, True])
def test_R32_a_plan_records_the_same_bits_through_c_and_through_wgpu_py(WgpuBackend, sparse):
    rng = np.random.default_rng(3)
    B, Hkv, G, D, S, BS, pages, topk, d_idx = 3, 2, 4, 16, 4, 8, 6, 2, 8
    P = B * pages
    bt = rng.permutation(P).reshape(B, pages).astype(np.int32)
    lens = rng.integers(BS, pages * S + 1, size=B).astype(np.int32)
    cu = np.arange(B + 1, dtype=np.int32)
    msb = pages // (BS // S)
    sel = np.stack([rng.permutation(msb)[:topk] for _ in range(B * Hkv)]).reshape(B, Hkv, topk).astype(np.int32)
    k, v = (rng.standard_normal((P, Hkv, S, D), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((B, Hkv * G, D), dtype=np.float32)
    iq = rng.standard_normal((B, Hkv, d_idx), dtype=np.float32)
    ik = rng.standard_normal((P, 1, S, d_idx), dtype=np.float32)
    results = []
    for through_c in (True, False):
        be = WgpuBackend()
        kd, vd = be.upload_kv_cache(k, v)
        plan = psa.plan_attention(bt, cu, lens, block_size=BS, page_size=S, num_q_heads=Hkv * G, num_kv_heads=Hkv,
                                  head_dim=D, kv_dtype="float32", topk=topk, causal=True, index_dim=d_idx,
                                  num_index_heads=1, index_dtype="float32", backend=be)
        rt = plan._runtime
        assert (rt.rec is not None) == (recorder(be.device_context.runtime) is not None)
        if not through_c:
            rt.rec = None
        if sparse:
            out = plan.run_sparse(be.asarray(q), kd, vd, be.asarray(iq), be.upload_index_cache(ik), return_lse=True)
        else:
            out = plan.run(be.asarray(q), kd, vd, be.asarray(sel), return_lse=True)
        results.append([x.numpy() for x in out])
        be.close()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*results))
