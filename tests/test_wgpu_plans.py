"""The wgpu plan runtime with device arrays (R30, R32): device inputs dropped at once, page writes
and decode steps between layers; every result equals the plain call's."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import paged_sparse_attn as psa


def _decode(seed, B=3, Hkv=2, G=2, D=8, S=4, BS=8, pages=4, topk=2):
    rng = np.random.default_rng(seed)
    P = B * pages
    bt = rng.permutation(P).reshape(B, pages).astype(np.int32)
    lens = rng.integers(1, pages * S + 1, size=B).astype(np.int32)
    cu = np.arange(B + 1, dtype=np.int32)
    msb = pages // (BS // S)
    sel = np.stack([rng.permutation(msb)[:topk] for _ in range(B * Hkv)]).reshape(B, Hkv, topk).astype(np.int32)
    k = rng.standard_normal((P, Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((P, Hkv, S, D), dtype=np.float32)
    qs = [rng.standard_normal((B, Hkv * G, D), dtype=np.float32) for _ in range(7)]
    return dict(bt=bt, lens=lens, cu=cu, sel=sel, k=k, v=v, qs=qs, S=S, BS=BS, Hkv=Hkv, G=G, D=D, topk=topk)


def _plan(be, c, block_tables=None):
    """The decode case's plan on ``be`` (its own ``block_tables`` unless given)."""
    bt = c["bt"] if block_tables is None else block_tables
    return psa.plan_attention(bt, c["cu"], c["lens"], block_size=c["BS"], page_size=c["S"],
                              num_q_heads=c["Hkv"] * c["G"], num_kv_heads=c["Hkv"], head_dim=c["D"],
                              kv_dtype="float32", topk=c["topk"], causal=True, backend=be)


def _prefill(seed, B=2, Tq=3, Hkv=2, G=2, D=8, S=4, BS=8, pages=4, topk=2):
    """A prefill case: ``Tq`` queries per sequence (the decode case's shapes otherwise)."""
    c = _decode(seed, B=B, Hkv=Hkv, G=G, D=D, S=S, BS=BS, pages=pages, topk=topk)
    rng = np.random.default_rng(seed + 100)
    msb = pages // (BS // S)
    c["lens"] = rng.integers(Tq, pages * S + 1, size=B).astype(np.int32)
    c["cu"] = (np.arange(B + 1) * Tq).astype(np.int32)
    c["sel"] = np.stack([rng.permutation(msb)[:topk] for _ in range(B * Tq * Hkv)]).reshape(
        B * Tq, Hkv, topk).astype(np.int32)
    c["qs"] = [rng.standard_normal((B * Tq, Hkv * G, D), dtype=np.float32) for _ in range(3)]
    return c


def test_R32_prefill_binds_a_device_q_where_it_is(WgpuBackend, monkeypatch):
    """A prefill plan binds a device ``q`` as it is, as decode does: the layer records no copy
    of its queries (the bench's prefill moved 64 MiB per layer that way), and every layer gives
    the bits of the same call with a host ``q``."""
    be = WgpuBackend()
    c = _prefill(4)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    assert not plan._runtime.decode
    qd = [be.asarray(q) for q in c["qs"]]
    sd = be.asarray(c["sel"])
    plan.run(qd[0], kd, vd, sd).numpy()  # warm: pipelines, bind groups, result buffers
    plan.run(c["qs"][0], kd, vd, sd)
    enc_class = type(plan._runtime.ctx.device.create_command_encoder())
    copies = []
    real = enc_class.copy_buffer_to_buffer
    monkeypatch.setattr(enc_class, "copy_buffer_to_buffer", lambda self, *a, **kw: (copies.append(a[0]),
                                                                                     real(self, *a, **kw))[1])
    for q, d in zip(c["qs"], qd):
        copies.clear()
        want = plan.run(q, kd, vd, sd)
        from_host = list(copies)
        copies.clear()
        got = plan.run(d, kd, vd, sd).numpy()
        assert d.buffer() not in copies, "the device q was copied"
        assert len(copies) == len(from_host), (copies, from_host)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(want, psa.forward(q, c["k"], c["v"], c["bt"], c["sel"], c["cu"], backend=be,
                                                        used_kv_lens=c["lens"], block_size=c["BS"], causal=True))
    plan.close()
    be.close()

def test_R32_device_layers_equal_single_calls_with_temporaries_dropped_at_once(WgpuBackend):
    be = WgpuBackend()
    c = _decode(1)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    # device inputs made inline and dropped at once
    outs = [plan.run(be.asarray(q), kd, vd, be.asarray(c["sel"])) for q in c["qs"]]
    gc.collect()
    for q, o in zip(c["qs"], outs):
        want = plan.run(q, kd, vd, c["sel"])  # host q and selection
        np.testing.assert_array_equal(o.numpy(), want)
    # a page write between layers: the layer before it sees the old page, the one after the new one
    o1 = plan.run(be.asarray(c["qs"][0]), kd, vd, be.asarray(c["sel"]))
    new_k = c["k"].copy()
    new_k[c["bt"][0, 0]] += 1.0
    kd.write_pages([int(c["bt"][0, 0])], new_k[[c["bt"][0, 0]]])
    o2 = plan.run(be.asarray(c["qs"][0]), kd, vd, be.asarray(c["sel"]))
    kw = dict(used_kv_lens=c["lens"], block_size=c["BS"], causal=True)
    np.testing.assert_array_equal(o1.numpy(), psa.forward(c["qs"][0], c["k"], c["v"], c["bt"], c["sel"], c["cu"],
                                                          backend=be, **kw))
    np.testing.assert_array_equal(o2.numpy(), psa.forward(c["qs"][0], new_k, c["v"], c["bt"], c["sel"], c["cu"],
                                                          backend=be, **kw))
    # a decode step after a layer: that layer keeps the lengths it ran with
    o3 = plan.run(be.asarray(c["qs"][1]), kd, vd, be.asarray(c["sel"]))
    plan.update(used_kv_lens=np.minimum(c["lens"] + 1, c["bt"].shape[1] * c["S"]).astype(np.int32))
    np.testing.assert_array_equal(o3.numpy(), psa.forward(c["qs"][1], new_k, c["v"], c["bt"], c["sel"], c["cu"],
                                                          backend=be, **kw))
    plan.close()
    be.close()


def test_R32_forward_sees_lengths_and_pages_changed_in_place(WgpuBackend):
    # a decode loop that updates its used_kv_lens and block_tables arrays in place: each plain
    # call through the plan cache equals a call on fresh copies of the arrays
    be = WgpuBackend()
    c = _decode(4, pages=6)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    bt, lens = c["bt"].copy(), c["lens"].copy()
    kw = dict(block_size=c["BS"], causal=True, backend=be)

    first = psa.forward(c["qs"][0], kd, vd, bt, c["sel"], c["cu"], used_kv_lens=lens, **kw)
    lens[:] = np.maximum(1, lens - 3)
    second = psa.forward(c["qs"][0], kd, vd, bt, c["sel"], c["cu"], used_kv_lens=lens, **kw)
    bt[:] = bt[::-1]
    third = psa.forward(c["qs"][0], kd, vd, bt, c["sel"], c["cu"], used_kv_lens=lens, **kw)
    ref = lambda b, n: psa.forward(c["qs"][0], c["k"], c["v"], b, c["sel"], c["cu"], used_kv_lens=n,  # noqa: E731
                                   block_size=c["BS"], causal=True, backend=be)
    np.testing.assert_array_equal(first, ref(c["bt"].copy(), c["lens"].copy()))
    np.testing.assert_array_equal(second, ref(c["bt"].copy(), lens.copy()))
    np.testing.assert_array_equal(third, ref(bt.copy(), lens.copy()))
    assert not np.array_equal(first, second) and not np.array_equal(second, third)


@pytest.mark.parametrize("B", [3, 4])  # out of 384 bytes (results copied in) or 512 (combined straight in)
def test_R32_device_results_written_in_place_or_copied_equal_host_results(WgpuBackend, B):
    """A device call's combine writes out and (m, l) into the result buffer itself when (m, l)
    starts at a 256-byte boundary, else they are copied there: either way every layer's out and
    lse equal the host call's, and results still held are never overwritten by later layers."""
    be = WgpuBackend()
    c = _decode(2, B=B)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    sd = be.asarray(c["sel"])
    held = [plan.run(be.asarray(q), kd, vd, sd, return_lse=True) for q in c["qs"]]
    for i in (0, 3):  # results dropped and their buffers recycled by the next layers
        held[i] = None
    gc.collect()
    more = [plan.run(be.asarray(q), kd, vd, sd, return_lse=True) for q in c["qs"][:3]]
    for q, res in list(zip(c["qs"], held)) + list(zip(c["qs"][:3], more)):
        if res is None:
            continue
        want_o, want_lse = plan.run(q, kd, vd, c["sel"], return_lse=True)
        np.testing.assert_array_equal(res[0].numpy(), want_o)
        np.testing.assert_array_equal(res[1].numpy(), want_lse)
    plan.close()
    be.close()


@pytest.mark.parametrize("B", [3, 4])  # results copied into their buffer (B = 3) or written there (4)
def test_R31_decode_error_words_belong_to_their_call(WgpuBackend, B):
    """Each decode call hands the R6 error words over to its own results and leaves them zero
    for the next call (psa_handoff.wgsl with device results, recorded four calls per submission;
    a clear before the pass and a copy after it with host results), so a violating call raises
    at its readback however many valid calls surround it, and never any valid call, held or read
    later; also after the inversion alone (kvouter_index) raised on it."""
    be = WgpuBackend()
    c = _decode(6, B=B)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    bad_sel = c["sel"].copy()
    bad_sel[1, 0, :2] = (0, 0)  # a repeated id (R6)
    good, bad = be.asarray(c["sel"]), be.asarray(bad_sel)
    want = [plan.run(q, kd, vd, c["sel"], return_lse=True) for q in c["qs"][:4]]
    sels = [good, bad, good, bad, bad, good, good]
    res = [plan.run(be.asarray(c["qs"][i % 4]), kd, vd, s, return_lse=True) for i, s in enumerate(sels)]
    for i, (s, r) in enumerate(zip(sels, res)):
        if s is bad:
            with pytest.raises(psa.SpecError, match=r"\[R6\]"):
                r[0].numpy()
        else:
            np.testing.assert_array_equal(r[0].numpy(), want[i % 4][0])
            np.testing.assert_array_equal(r[1].numpy(), want[i % 4][1])
    with pytest.raises(psa.SpecError, match=r"\[R6\]"):  # host results: the call reads its own words
        plan.run(c["qs"][0], kd, vd, bad)
    np.testing.assert_array_equal(plan.run(c["qs"][1], kd, vd, good), want[1][0])
    with pytest.raises(psa.SpecError, match=r"\[R6\]"):
        plan.kvouter_index(bad)
    np.testing.assert_array_equal(plan.run(be.asarray(c["qs"][2]), kd, vd, good).numpy(), want[2][0])
    plan.close()
    be.close()


@pytest.mark.parametrize("B", [3, 4])  # results copied into their buffer (B = 3) or written there (4)
def test_R32_a_model_step_of_many_layers_makes_no_bind_groups_once_warm(WgpuBackend, B):
    """Each layer brings its own queries: a plan must keep a bind group per layer's tensors (a
    cache of 32 made new ones on every layer of a 32-layer loop: 1.5-2 x the host time)."""
    be = WgpuBackend()
    c = _decode(2, B=B)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    rng = np.random.default_rng(0)
    hq = [rng.standard_normal(c["qs"][0].shape, dtype=np.float32) for _ in range(48)]
    qd = [be.asarray(q) for q in hq]
    sd = be.asarray(c["sel"])

    def step():  # a model's layers: each result used, then dropped (its buffer goes back to the plan)
        return [plan.run(q, kd, vd, sd).numpy() for q in qd]

    step()
    step()
    made = plan._runtime.bind_groups_made
    outs = step()
    assert plan._runtime.bind_groups_made == made, "a warm loop over the same layers made bind groups"
    for i in (0, 17, 47):
        np.testing.assert_array_equal(outs[i], plan.run(hq[i], kd, vd, c["sel"]))
    plan.close()
    be.close()


@pytest.mark.parametrize("device", [False, True])
def test_R32_caches_checked_again_after_update(WgpuBackend, device):
    """A cache that passed a plan's checks is checked again after ``update`` brings new pages: it
    may be too small for them now (R2)."""
    be = WgpuBackend()
    c = _decode(3)
    P = c["k"].shape[0]
    k, v = c["k"][:P - 1], c["v"][:P - 1]  # one page short of the pool: still holds every page in use?
    bt = c["bt"].copy()
    bt[bt == P - 1] = 0  # no page refers to the missing one yet
    kd, vd = be.upload_kv_cache(k, v) if device else (k, v)
    plan = _plan(be, c, block_tables=bt)
    q = be.asarray(c["qs"][0]) if device else c["qs"][0]
    sel = be.asarray(c["sel"]) if device else c["sel"]
    plan.run(q, kd, vd, sel)
    bt2 = bt.copy()
    bt2[0, 0] = P - 1  # a page the caches do not have
    plan.update(block_tables=bt2)
    with pytest.raises(psa.SpecError, match=r"R2"):
        plan.run(q, kd, vd, sel)
    plan.close()
    be.close()


def test_R35_synchronize_waits_with_one_mapped_word_and_opens_no_device_after_close(WgpuBackend):
    be = WgpuBackend()
    be.synchronize()  # nothing submitted yet
    c = _decode(5)
    kd, vd = be.upload_kv_cache(c["k"], c["v"])
    plan = _plan(be, c)
    outs = [plan.run(be.asarray(q), kd, vd, be.asarray(c["sel"]), return_lse=True) for q in c["qs"]]
    ctx = be.device_context
    be.synchronize()
    if ctx.runtime.work_done_wait:
        assert ctx.sync_buffers is None
    else:  # wgpu-native: the mapped 4-byte copy, made once and left unmapped
        src, rb = ctx.sync_buffers
        assert rb.map_state == "unmapped"
        plan.synchronize()
        assert ctx.sync_buffers == (src, rb)
    for q, (o, lse) in zip(c["qs"], outs):
        want = plan.run(q, kd, vd, c["sel"], return_lse=True)
        np.testing.assert_array_equal(o.numpy(), want[0])
        np.testing.assert_array_equal(lse.numpy(), want[1])
    be.close()
    be.synchronize()  # closed: nothing to wait for, no new device
    assert be.device_context is None


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 1000])
def test_R30_device_arrays_of_any_byte_count_read_back_as_they_went(WgpuBackend, n):
    """One copy out of a mapped buffer of whole words: arrays whose bytes are not a multiple of 4
    (float16, int8) come back without their padding."""
    be = WgpuBackend()
    rng = np.random.default_rng(n)
    for x in (rng.standard_normal(n).astype(np.float16), rng.integers(-100, 100, n).astype(np.int8),
              rng.standard_normal((n, 3)).astype(np.float32)):
        got = be.asarray(x).numpy()
        assert got.dtype == x.dtype and got.shape == x.shape
        assert got.tobytes() == x.tobytes()


def test_R35_synchronize_on_a_lost_device_raises_and_the_backend_moves_to_a_new_one(WgpuBackend):
    be = WgpuBackend()
    old = be.device_context.device
    old.destroy()
    with pytest.raises(psa.DeviceError, match="synchronize"):
        be.synchronize()
    assert be.device_context is None, "a lost device is closed (the backend's device-loss policy)"
    be.synchronize()  # nothing left to wait for
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(be.asarray(x).numpy(), x)  # on a new device
    assert be.device_context.device is not old


@pytest.mark.parametrize("sparse", [False, True])
def test_R32_a_plan_records_the_same_bits_through_c_and_through_wgpu_py(WgpuBackend, sparse):
    """A plan records its dispatches through the runtime's C functions (``_record.py``); the
    same plan through wgpu-py's calls gives the same bits."""
    from paged_sparse_attn.backends.wgpu._record import recorder

    c = _decode(11)
    d_idx = 8
    rng = np.random.default_rng(11)
    iq = rng.standard_normal((c["bt"].shape[0], c["Hkv"], d_idx), dtype=np.float32)
    ik = rng.standard_normal((c["k"].shape[0], 1, c["S"], d_idx), dtype=np.float32)
    results = []
    for through_c in (True, False):
        be = WgpuBackend()
        kd, vd = be.upload_kv_cache(c["k"], c["v"])
        plan = psa.plan_attention(c["bt"], c["cu"], c["lens"], block_size=c["BS"], page_size=c["S"],
                                  num_q_heads=c["Hkv"] * c["G"], num_kv_heads=c["Hkv"], head_dim=c["D"],
                                  kv_dtype="float32", topk=c["topk"], causal=True, index_dim=d_idx,
                                  num_index_heads=1, index_dtype="float32", backend=be)
        rt = plan._runtime
        assert (rt.rec is not None) == (recorder(be.device_context.runtime) is not None)
        if not through_c:
            rt.rec = None
        q = be.asarray(c["qs"][0])
        if sparse:
            out = plan.run_sparse(q, kd, vd, be.asarray(iq), be.upload_index_cache(ik), return_lse=True)
        else:
            out = plan.run(q, kd, vd, be.asarray(c["sel"]), return_lse=True)
        results.append([x.numpy() for x in out])
        be.close()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*results))



def test_R13_device_inversion_of_uneven_sequences_binds_the_selection_and_numbers_items(WgpuBackend, monkeypatch):
    """The device inversion (``psa_invert.wgsl``: a flag bit per (head, query, block), the items
    of a slot group numbered from its edge count) on sequences whose query counts are no multiple
    of 32, so that slot groups start and end inside flag words, with empty slots and blocks a
    query cannot see: the index equals the host's (R13, R33), before and after attention layers,
    every layer the plain call's bits, and a device selection is bound where it is (no copy)."""
    be = WgpuBackend()
    rng = np.random.default_rng(7)
    T, lens, Hkv, G, D, S, BS, pages, topk = [37, 5, 60], [50, 9, 64], 2, 2, 8, 4, 8, 16, 3
    B, msb = len(T), pages * S // BS
    cu = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)
    bt = rng.permutation(B * pages).reshape(B, pages).astype(np.int32)
    k = rng.standard_normal((B * pages, Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((B * pages, Hkv, S, D), dtype=np.float32)
    sels = []
    for _ in range(3):
        sel = np.stack([rng.permutation(msb)[:topk] for _ in range(cu[-1] * Hkv)]).reshape(cu[-1], Hkv, topk)
        sel[rng.random(sel.shape) < 0.2] = -1
        sels.append(sel.astype(np.int32))
    c = {"bt": bt, "cu": cu, "lens": np.array(lens, np.int32), "BS": BS, "S": S, "Hkv": Hkv, "G": G, "D": D,
         "topk": topk}
    plan = _plan(be, c)
    assert not plan._runtime.decode and plan._runtime.geometry["epi"] > 1  # items of several edges
    kd, vd = be.upload_kv_cache(k, v)
    kw = {"used_kv_lens": c["lens"], "block_size": BS, "causal": True}

    def index_equal(sel):
        got, want = plan.kvouter_index(sel), psa.build_kvouter_index(sel, bt, cu, page_size=S, **kw)
        for f in ("edge_query", "edge_head", "edge_seq", "edge_block", "edge_rank", "edge_len", "slot_ptr",
                  "row_ptr", "row_edges"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)

    index_equal(sels[0])
    enc_class = type(plan._runtime.ctx.device.create_command_encoder())
    copied = []
    real = enc_class.copy_buffer_to_buffer
    monkeypatch.setattr(enc_class, "copy_buffer_to_buffer", lambda self, *a, **kw: (copied.append(a[0]),
                                                                                     real(self, *a, **kw))[1])
    for sel in sels:
        q = rng.standard_normal((cu[-1], Hkv * G, D), dtype=np.float32)
        sd = be.asarray(sel)
        got = plan.run(be.asarray(q), kd, vd, sd).numpy()
        assert sd.buffer() not in copied, "the device selection was copied"
        np.testing.assert_array_equal(got, psa.forward(q, k, v, bt, sel, cu, backend=be, **kw))
        index_equal(sel)
    plan.close()
    be.close()
