"""Dispatches recorded through the runtimes' C functions (``_record.py``): an invalid one still
raises (from the encoder's finish). That a plan's results are the same bits either way is in
``test_wgpu_plans.py``."""

from __future__ import annotations

import pytest

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
