"""Several planned layers per submission on the wgpu backend (R36): the same bits as one
submission each, no write or read overtaking recorded work, nothing lost when recording fails."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from test_wgpu_plans import _decode, _plan

import paged_sparse_attn as psa


def _open_layers(be) -> int:
    b = be.device_context.batch
    return 0 if b is None else b.layers


@pytest.mark.parametrize("n", [2, 4, 5])
def test_R36_layers_recorded_together_equal_layers_submitted_one_by_one(WgpuBackend, n):
    c = _decode(11, B=4)
    outs = {}
    for per in (1, n):
        be = WgpuBackend(layers_per_submission=per)
        kd, vd = be.upload_kv_cache(c["k"], c["v"])
        plan = _plan(be, c)
        sd = be.asarray(c["sel"])
        qd = [be.asarray(q) for q in c["qs"]]
        res, held = [], []
        be.synchronize()  # (the device idle: its first layer goes at once)
        for i, q in enumerate(qd):
            res.append(plan.run(q, kd, vd, sd, return_lse=True))
            held.append(_open_layers(be))
            assert be.last_timings["batched"] is (per > 1)
        # the open batch holds the layers since the last submission, never more than n; the
        # first layer, recorded while the device had nothing to do, was submitted by itself
        assert held == ([0] * len(qd) if per == 1 else [0] + [i % per for i in range(1, len(qd))])
        outs[per] = [(o.numpy(), lse.numpy()) for o, lse in res]
        assert _open_layers(be) == 0  # a read submits what was recorded
        plan.close()
        be.close()
    for (o1, l1), (o2, l2) in zip(outs[1], outs[n]):
        np.testing.assert_array_equal(o1, o2)
        np.testing.assert_array_equal(l1, l2)


def test_R36_writes_updates_and_other_calls_come_after_recorded_layers(WgpuBackend):
    """Recorded layers run before anything the queue is asked to do after them: a page write, a
    decode step's update, a host call, a plain forward(); each layer sees what it was called with."""
    be = WgpuBackend(layers_per_submission=8)
    c = _decode(12, pages=6)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    sd = be.asarray(c["sel"])
    kw = {"block_size": c["BS"], "causal": True, "backend": be}

    def ref(q, k, lens):
        return psa.forward(q, k, c["v"], c["bt"], c["sel"], c["cu"], used_kv_lens=lens, **kw)

    o1 = plan.run(be.asarray(c["qs"][0]), kd, vd, sd)
    assert _open_layers(be) == 1
    new_k = c["k"].copy()
    page = int(c["bt"][0, 0])
    new_k[page] += 1.0
    kd.write_pages([page], new_k[[page]])  # a host write: the recorded layer is submitted first
    assert _open_layers(be) == 0
    o2 = plan.run(be.asarray(c["qs"][1]), kd, vd, sd)
    lens2 = np.maximum(1, c["lens"] - 2).astype(np.int32)
    plan.update(used_kv_lens=lens2)
    o3 = plan.run(be.asarray(c["qs"][2]), kd, vd, sd)
    host = plan.run(c["qs"][3], kd, vd, c["sel"])  # host q: a submission of its own, after o3's
    o4 = plan.run(be.asarray(c["qs"][4]), kd, vd, sd)
    plain = psa.forward(c["qs"][5], kd, vd, c["bt"], c["sel"], c["cu"], used_kv_lens=lens2, **kw)
    np.testing.assert_array_equal(o1.numpy(), ref(c["qs"][0], c["k"], c["lens"]))
    np.testing.assert_array_equal(o2.numpy(), ref(c["qs"][1], new_k, c["lens"]))
    np.testing.assert_array_equal(o3.numpy(), ref(c["qs"][2], new_k, lens2))
    np.testing.assert_array_equal(host, ref(c["qs"][3], new_k, lens2))
    np.testing.assert_array_equal(o4.numpy(), ref(c["qs"][4], new_k, lens2))
    np.testing.assert_array_equal(plain, ref(c["qs"][5], new_k, lens2))
    plan.close()
    be.close()


def test_R36_inputs_dropped_while_recorded_are_kept_until_submitted(WgpuBackend):
    """A device q released (or collected) right after its layer was recorded is destroyed only
    once the batch is submitted: the layer still reads it."""
    be = WgpuBackend(layers_per_submission=8)
    c = _decode(13)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    sd = be.asarray(c["sel"])
    qds = [be.asarray(q) for q in c["qs"][:4]]  # (each upload submits what is open: before the layers)
    outs = [plan.run(qd, kd, vd, sd) for qd in qds]
    qds[1].release()
    qds[3].release()
    del qds
    gc.collect()
    assert _open_layers(be) == 4
    for q, o in zip(c["qs"], outs):
        np.testing.assert_array_equal(o.numpy(), plan.run(q, kd, vd, c["sel"]))
    plan.close()
    be.close()


def test_R36_a_failure_while_recording_drops_the_batch_and_its_calls_raise(WgpuBackend, monkeypatch):
    """If recording a layer fails, the open batch is incomplete: it is dropped, the calls it held
    raise DeviceError naming R36 when read (never a result that was not computed), and the
    plan's next calls run as usual."""
    be = WgpuBackend(layers_per_submission=8)
    c = _decode(14)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    sd = be.asarray(c["sel"])
    qds = [be.asarray(q) for q in c["qs"][:4]]  # (an upload submits what is open: all before the layers)
    done = [plan.run(qd, kd, vd, sd) for qd in qds[:2]]
    assert _open_layers(be) == 2
    rt = plan._runtime
    real = type(rt)._partials_group

    def broken(self, *a, **k):
        raise MemoryError("no bind group (test)")

    monkeypatch.setattr(type(rt), "_partials_group", broken)
    with pytest.raises(psa.DeviceError):
        plan.run(qds[2], kd, vd, sd)
    monkeypatch.setattr(type(rt), "_partials_group", real)
    assert be.device_context.batch is None
    for o in done:
        with pytest.raises(psa.DeviceError, match=r"\[R36\]"):
            o.numpy()
    after = plan.run(qds[3], kd, vd, sd)
    np.testing.assert_array_equal(after.numpy(), plan.run(c["qs"][3], kd, vd, c["sel"]))
    plan.close()
    be.close()


@pytest.mark.psa_backends(exclude=("numpy",))
def test_R36_synchronize_submits_the_open_batch(backend):
    """On every GPU backend: Dawn's wait polls the queue (it must submit the batch first)."""
    be = type(backend)(layers_per_submission=16)
    c = _decode(15)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    sd = be.asarray(c["sel"])
    o0 = plan.run(be.asarray(c["qs"][0]), kd, vd, sd)
    o = plan.run(be.asarray(c["qs"][1]), kd, vd, sd)
    assert _open_layers(be) == 1
    be.synchronize()
    assert be.device_context.batch is None
    np.testing.assert_array_equal(o0.numpy(), plan.run(c["qs"][0], kd, vd, c["sel"]))
    np.testing.assert_array_equal(o.numpy(), plan.run(c["qs"][1], kd, vd, c["sel"]))
    plan.close()
    be.close()


@pytest.mark.psa_backends(exclude=("numpy",))
def test_R36_an_idle_device_gets_its_first_layer_at_once(backend):
    """A batch is not held open while the device has nothing to do: after a wait for the whole
    queue (``synchronize``) the next layer is submitted by itself, the ones after it together."""
    be = type(backend)(layers_per_submission=4)
    c = _decode(17)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    sd = be.asarray(c["sel"])
    qd = [be.asarray(q) for q in c["qs"]]
    for _ in range(2):
        be.synchronize()
        assert be.device_context.queue_idle
        held = []
        for q in qd[:3]:
            plan.run(q, kd, vd, sd)
            held.append(_open_layers(be))
        assert held == [0, 1, 2] and not be.device_context.queue_idle
    outs = [plan.run(q, kd, vd, sd) for q in qd[:3]]
    be.synchronize()
    for q, o in zip(c["qs"], outs):
        np.testing.assert_array_equal(o.numpy(), plan.run(q, kd, vd, c["sel"]))
    plan.close()
    be.close()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_R36_layers_per_submission_is_checked(WgpuBackend, bad):
    with pytest.raises(ValueError, match=r"layers_per_submission.*\[R36\]"):
        WgpuBackend(layers_per_submission=bad)


def test_R36_a_backend_dropped_with_a_batch_open_holds_no_destruction_back(WgpuBackend):
    """Buffers wait for open batches before they are destroyed; a batch left open by a backend
    nobody closed must not make every later destruction wait (the open batches are held weakly)."""
    from paged_sparse_attn.backends.wgpu import _batch

    be = WgpuBackend(layers_per_submission=8)
    c = _decode(16)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    sd, qd = be.asarray(c["sel"]), be.asarray(c["qs"][0])
    plan.run(qd, kd, vd, sd)
    key = id(be.device_context)
    assert _batch._open.get(key) is be.device_context
    others = len(_batch._open) - 1  # (batches other tests' backends may have left open)
    del be, kd, vd, plan, sd, qd
    gc.collect()
    assert key not in _batch._open and len(_batch._open) == others
    if not others:
        assert not _batch.retire([])  # nothing open: a destruction happens at once
