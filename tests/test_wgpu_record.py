"""Dispatches and untimed passes recorded through the runtimes' C functions (``_record.py``): an
invalid dispatch still raises (from the encoder's finish), in a pass begun by wgpu-py or through
the C functions, and from the recorder's own finish and submission of an encoder it made; a pass
begun through them runs what it records, and so does an encoder the recorder made and submitted.
That a plan's results are the same bits either way is in ``test_wgpu_plans.py``."""

from __future__ import annotations

import pytest

from paged_sparse_attn.backends.wgpu._record import recorder

WRITE_ONE = ("@group(0) @binding(0) var<storage, read_write> a: array<u32>;\n"
             "@compute @workgroup_size(1) fn main() { a[0] = 1u; }")
WRITE_U = ("@group(0) @binding(0) var<uniform> u: vec4<u32>;\n"
           "@group(0) @binding(1) var<storage, read_write> a: array<u32>;\n"
           "@compute @workgroup_size(1) fn main() { a[0] = u.x; }")


def _record_mismatched_dispatch(device, runtime, c_pass=False, c_encoder=False):
    """Record, through the C functions, a dispatch whose bind group does not fit the pipeline
    (in a pass begun through them with ``c_pass``, in an encoder the recorder made with
    ``c_encoder``); return the encoder (its finish must raise)."""
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
    rec = recorder(runtime)
    enc = rec.encoder(device) if c_encoder else device.create_command_encoder()
    cp = rec.begin(enc) if c_pass else enc.begin_compute_pass()
    rec.dispatch3(cp, p1, wrong, 1, 1)  # p1's group 0 is one storage buffer
    cp.end()
    return enc


@pytest.mark.parametrize("c_pass", [False, True], ids=["wgpu-py pass", "C pass"])
def test_an_invalid_dispatch_recorded_through_c_raises_at_finish_on_wgpu_native(WgpuBackend, c_pass):
    be = WgpuBackend()
    ctx = be.device_context
    assert recorder(ctx.runtime) is not None, "wgpu-native's layers record through its C functions"
    enc = _record_mismatched_dispatch(ctx.device, ctx.runtime, c_pass)
    gpu = ctx.runtime.gpu()
    with pytest.raises(gpu.GPUValidationError, match="(?i)bind ?group"):
        enc.finish()


@pytest.mark.parametrize("c_pass", [False, True], ids=["wgpu-py pass", "C pass"])
def test_an_invalid_dispatch_recorded_through_c_raises_at_finish_on_dawn(dawn_runtime, c_pass):
    """Dawn's Null adapter validates every command and runs nothing: enough for this check."""
    device = dawn_runtime.null_adapter().request_device_sync()
    enc = _record_mismatched_dispatch(device, dawn_runtime, c_pass)
    gpu = dawn_runtime.gpu()
    with pytest.raises(gpu.GPUValidationError):
        enc.finish()


def test_a_pass_begun_through_c_runs_what_it_records_and_must_be_ended(WgpuBackend):
    """A pass begun through the C functions runs its dispatches (read back on the device); an
    encoder whose such pass was never ended does not finish (the open pass is an error, never
    silently dropped work)."""
    be = WgpuBackend()
    ctx = be.device_context
    device, gpu = ctx.device, ctx.runtime.gpu()
    U = gpu.BufferUsage
    pipe = device.create_compute_pipeline(layout="auto", compute={
        "module": device.create_shader_module(code=WRITE_ONE), "entry_point": "main"})
    buf = device.create_buffer(size=16, usage=U.STORAGE | U.COPY_SRC)
    bg = device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": buf}}])
    rec = recorder(ctx.runtime)
    enc = device.create_command_encoder()
    cp = rec.begin(enc)
    rec.dispatch3(cp, pipe, bg, 1, 1)
    cp.end()
    cp.end()  # (a second end does nothing: the handle is gone)
    device.queue.submit([enc.finish()])
    assert bytes(device.queue.read_buffer(buf, 0, 4)) == (1).to_bytes(4, "little")
    enc = device.create_command_encoder()
    cp = rec.begin(enc)
    rec.dispatch3(cp, pipe, bg, 1, 1)
    with pytest.raises(gpu.GPUValidationError):
        enc.finish()
    del cp  # (its handle released unended)


def test_the_recorders_submission_raises_for_an_invalid_encoder_on_wgpu_native(WgpuBackend):
    be = WgpuBackend()
    ctx = be.device_context
    rec = recorder(ctx.runtime)
    assert rec.encodes, "wgpu-native's layers make and submit their encoders through its checked C calls"
    enc = _record_mismatched_dispatch(ctx.device.raw, ctx.runtime, c_pass=True, c_encoder=True)
    with pytest.raises(ctx.runtime.gpu().GPUValidationError, match="(?i)bind ?group"):
        rec.submit(ctx.device.raw.queue, enc)


def test_the_recorders_submission_raises_for_an_invalid_encoder_on_dawn(dawn_runtime):
    device = dawn_runtime.null_adapter().request_device_sync()
    rec = recorder(dawn_runtime)
    assert rec.encodes
    enc = _record_mismatched_dispatch(device, dawn_runtime, c_pass=True, c_encoder=True)
    with pytest.raises(dawn_runtime.gpu().GPUValidationError):
        rec.submit(device.queue, enc)


def test_an_encoder_the_recorder_made_and_submitted_runs_what_it_records(WgpuBackend):
    """The recorder's encoder (labelled as the library's) runs its commands once submitted
    through the checked C calls: a dispatch and a copy, read back on the device."""
    be = WgpuBackend()
    ctx = be.device_context
    device, gpu = ctx.device.raw, ctx.runtime.gpu()
    U = gpu.BufferUsage
    pipe = device.create_compute_pipeline(layout="auto", compute={
        "module": device.create_shader_module(code=WRITE_ONE), "entry_point": "main"})
    buf = device.create_buffer(size=16, usage=U.STORAGE | U.COPY_SRC)
    out = device.create_buffer(size=16, usage=U.COPY_DST | U.COPY_SRC)
    bg = device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": buf}}])
    rec = recorder(ctx.runtime)
    enc = rec.encoder(device)
    assert enc.label == "paged_sparse_attn.layer"
    cp = rec.begin(enc)
    rec.dispatch3(cp, pipe, bg, 1, 1)
    cp.end()
    enc.copy_buffer_to_buffer(buf, 0, out, 0, 16)
    rec.submit(device.queue, enc)
    assert bytes(device.queue.read_buffer(out, 0, 4)) == (1).to_bytes(4, "little")
