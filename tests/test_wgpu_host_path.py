"""The host path of a wgpu call: what it keeps between calls must never change a result.

A call reuses pooled buffers and cached bind groups (``backends/wgpu/_transfer.py``) and does one
command encoder, one submission and one readback map. These tests pin down the invariants:

* a reused bind group binds exactly the buffers a fresh one would: across new selections, pool
  growth, caches released and uploaded again (R19: the bits of a fresh backend);
* a resident cache dropped without ``release()`` still frees its buffers, although cached bind
  groups refer to them;
* one encoder, one submit, one map per call (the host cost of a decode step).

These tests require the backend (CI installs lavapipe); a missing driver is a failure.
"""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest

import paged_sparse_attn as psa

from paged_sparse_attn.testing.generate import random_problem


@pytest.fixture
def be(WgpuBackend):
    b = WgpuBackend(required_limits="default")
    yield b
    b.close()


@contextlib.contextmanager
def counting(cls, *names):
    """Count calls of methods ``names`` of wgpu-native class ``cls`` (or of the class itself
    where ``cls`` is one) inside the block."""
    from wgpu.backends import wgpu_native

    klass = cls if isinstance(cls, type) else getattr(wgpu_native, cls)
    counts = dict.fromkeys(names, 0)
    own = {n: klass.__dict__.get(n) for n in names}  # None: inherited
    olds = {n: getattr(klass, n) for n in names}

    def wrap(n):
        def f(self, *a, **kw):
            counts[n] += 1
            return olds[n](self, *a, **kw)
        return f

    for n in names:
        setattr(klass, n, wrap(n))
    try:
        yield counts
    finally:
        for n in names:
            if own[n] is None:
                delattr(klass, n)
            else:
                setattr(klass, n, own[n])


def _problem(seed, **kw):
    return random_problem(seed, **{"seqlens_q": (1, 1, 1), "G": 4, "D": 8, "msb": 4, "causal": True,
                                 "poison": False, **kw})


def _fresh(WgpuBackend, pb, k=None, v=None):
    """The bits of a backend that never ran anything before."""
    b = WgpuBackend(required_limits="default")
    try:
        kd, vd = b.upload_kv_cache(pb.k_cache if k is None else k, pb.v_cache if v is None else v)
        return psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=b, return_lse=True)
    finally:
        b.close()


def _same(a, b):
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_R19_reused_bind_groups_give_the_bits_of_a_fresh_backend(WgpuBackend, be):
    """New selections over the same resident caches reuse the bind groups (none made); caches
    released and uploaded again, and pooled buffers grown, get new ones: every result is the
    bits of a fresh backend."""
    pb = _problem(1)
    kd, vd = be.upload_kv_cache(pb.k_cache, pb.v_cache)
    out = psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=be, return_lse=True)
    assert _same(out, _fresh(WgpuBackend, pb))
    for seed in (2, 3):  # same caches and shapes, new selections: nothing to bind anew
        other = _problem(seed)
        sel = other.selected.copy()
        with counting("GPUDevice", "create_bind_group") as made:
            got = psa.forward(pb.q, kd, vd, pb.block_tables, sel, pb.cu_seqlens_q, **pb.options,
                              backend=be, return_lse=True)
        assert made["create_bind_group"] == 0, "bind groups were not reused"
        want = _fresh(WgpuBackend, pb.__class__(**{**pb.__dict__, "selected": sel}))
        assert _same(got, want), f"selection {seed}: different bits with reused bind groups"
    # other contents in new buffers: a bind group of the released ones must never be hit
    kd.release()
    vd.release()
    k2, v2 = pb.k_cache[::-1].copy(), pb.v_cache[::-1].copy()
    kd, vd = be.upload_kv_cache(k2, v2)
    got = psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=be, return_lse=True)
    assert _same(got, _fresh(WgpuBackend, pb, k2, v2)), "a stale bind group was used after a re-upload"
    # a larger call grows the pooled buffers (new buffers, new bind groups); a small one after it
    big = _problem(4, seqlens_q=(1,) * 9, msb=6)
    kb, vb = be.upload_kv_cache(big.k_cache, big.v_cache)
    got = psa.forward(big.q, kb, vb, *big.args[3:], **big.options, backend=be, return_lse=True)
    assert _same(got, _fresh(WgpuBackend, big))
    got = psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=be, return_lse=True)
    assert _same(got, _fresh(WgpuBackend, pb, k2, v2))
    for a in (kd, vd, kb, vb):
        a.release()


def test_a_resident_cache_dropped_without_release_frees_its_buffers(be):
    """Cached bind groups refer to the cache's buffers; dropping the arrays must still destroy
    them (else their device memory would stay held until the bind groups age out)."""
    from wgpu.backends import wgpu_native

    pb = _problem(5)
    kd, vd = be.upload_kv_cache(pb.k_cache, pb.v_cache)
    psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=be)  # caches bind groups of them
    ids = {b.uid for a in (kd, vd) for b in a.buffers()}
    destroyed = set()
    old = wgpu_native.GPUBuffer.destroy

    def destroy(self):
        destroyed.add(self.uid)
        return old(self)

    wgpu_native.GPUBuffer.destroy = destroy
    try:
        del kd, vd
        gc.collect()
    finally:
        wgpu_native.GPUBuffer.destroy = old
    assert ids <= destroyed, "a dropped resident cache kept its device buffers"


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "host-caches"])
def test_one_encoder_one_submit_one_map_per_call(be, resident):
    pb = _problem(6)
    k, v = be.upload_kv_cache(pb.k_cache, pb.v_cache) if resident else (pb.k_cache, pb.v_cache)
    psa.forward(pb.q, k, v, *pb.args[3:], **pb.options, backend=be)  # warm: pipelines, pool
    from paged_sparse_attn.backends.wgpu._record import Recorder

    # (a planned call makes and submits its encoder through the runtime's checked C calls)
    with counting("GPUDevice", "create_command_encoder") as enc, counting("GPUQueue", "submit") as sub, \
            counting("GPUBuffer", "map_sync", "map_async") as maps, counting(Recorder, "encoder", "submit") as rec:
        out = psa.forward(pb.q, k, v, *pb.args[3:], **pb.options, backend=be)
    ref = psa.forward(*pb.args, **pb.options, backend="numpy")
    assert np.allclose(out, ref, atol=1e-4)
    assert enc["create_command_encoder"] + rec["encoder"] == 1 and sub["submit"] + rec["submit"] == 1, (enc, sub, rec)
    assert maps["map_async"] == 1, maps  # (map_sync calls map_async once)
