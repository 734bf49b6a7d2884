"""The conformance kit for plans and device arrays (R30-R33, R35, R36; R7 for their float16 q), on
every selected backend.

Collected with the rest of the kit (``pytest --pyargs paged_sparse_attn.testing --backend
NAME``); ``tests/test_plan_properties.py`` re-exports these tests for the project's own run. A
backend that declares ``device_arrays`` is also run with device-resident caches, queries and
selections (through its ``upload_kv_cache`` and ``asarray``).
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the conformance suite needs hypothesis: pip install 'paged_sparse_attn[test]'") from exc

import paged_sparse_attn as psa
from paged_sparse_attn.testing import strategies as pst
from paged_sparse_attn.testing.assertions import assert_attention_close
from paged_sparse_attn.testing.problem import AttentionProblem

INDEX_FIELDS = ("edge_query", "edge_head", "edge_seq", "edge_block", "edge_rank", "edge_len", "slot_ptr",
                "slot_head", "slot_seq", "slot_block", "row_ptr", "row_edges")


def _problem(data, backend, **kw) -> AttentionProblem:
    return data.draw(pst.problems(caps=backend.capabilities, **kw), label="problem")


def _plan(backend, p: AttentionProblem, **kw):
    return psa.plan_attention(p.block_tables, p.cu_seqlens_q, p.used_kv_lens, block_size=p.block_size,
                              page_size=p.page_size, num_q_heads=p.num_q_heads, num_kv_heads=p.num_kv_heads,
                              head_dim=p.head_dim, kv_dtype=p.k_cache.dtype, topk=p.selected.shape[2],
                              causal=p.causal, softmax_scale=p.softmax_scale, backend=backend, **kw)


def _has_device(backend) -> bool:
    return bool(backend.capabilities.device_arrays) and hasattr(backend, "upload_kv_cache")


def _caches(backend, k, v):
    """Device-resident caches where the backend has them (its plan path), else the host arrays."""
    return backend.upload_kv_cache(k, v) if _has_device(backend) else (k, v)


def _bits(a, b) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b))


def _host(x):
    return x.numpy() if isinstance(x, psa.DeviceArray) else x


@given(data=st.data())
def test_R32_plan_run_equals_forward_bit_for_bit(backend, data):
    p = _problem(data, backend)
    k, v = _caches(backend, p.k_cache, p.v_cache)
    got = _plan(backend, p).run(p.q, k, v, p.selected, return_lse=True)
    want = psa.forward(p.q, k, v, p.block_tables, p.selected, p.cu_seqlens_q, used_kv_lens=p.used_kv_lens,
                       block_size=p.block_size, softmax_scale=p.softmax_scale, causal=p.causal, backend=backend,
                       return_lse=True)
    assert _bits(got, want), "R32: plan.run() and forward() gave different bits"
    ref, ref_lse = p.reference()
    assert_attention_close(got[0], ref, dtype=p.dtypes, lse=got[1], ref_lse=ref_lse,
                           err_msg=f"R32 plan.run vs dense_reference [{backend.name}]:")


@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_R32_plan_reused_across_layers_and_decode_steps(backend, data, seed):
    """One plan, two layers, then a decode step (lengths grown, a page mapped): fresh plans agree."""
    p = _problem(data, backend)
    rng = np.random.default_rng(seed)
    plan = _plan(backend, p)
    layers = []
    for i in range(2):
        q = rng.standard_normal(p.q.shape).astype(p.q.dtype) if i else p.q
        kh = rng.standard_normal(p.k_cache.shape).astype(p.k_cache.dtype) if i else p.k_cache
        vh = rng.standard_normal(p.v_cache.shape).astype(p.v_cache.dtype) if i else p.v_cache
        layers.append((q, *_caches(backend, kh, vh)))
    for q, k, v in layers:
        got = plan.run(q, k, v, p.selected, return_lse=True)
        want = _plan(backend, p).run(q, k, v, p.selected, return_lse=True)
        assert _bits(got, want), "R32: a plan reused for another layer differs from a fresh plan"
    # a decode step: every sequence one token longer (within capacity), unmapped pages mapped
    cap = p.msb * p.block_size
    lens = np.minimum(p.kv_lens + 1, cap).astype(np.int32)
    bt = np.where(p.block_tables < 0, int(rng.integers(0, p.num_pages)), p.block_tables).astype(np.int32)
    plan.update(used_kv_lens=lens, block_tables=bt)
    stepped = AttentionProblem(p.q, p.k_cache, p.v_cache, bt, p.selected, p.cu_seqlens_q, lens, p.block_size,
                               p.softmax_scale, p.causal)
    for q, k, v in layers:
        got = plan.run(q, k, v, p.selected, return_lse=True)
        want = _plan(backend, stepped).run(q, k, v, p.selected, return_lse=True)
        assert _bits(got, want), "R32: plan.update() then run differs from a fresh plan of the new layout"


@given(data=st.data())
def test_R33_plan_inversion_equals_build_kvouter_index(backend, data):
    p = _problem(data, backend)
    got = _plan(backend, p).kvouter_index(p.selected)
    want = psa.build_kvouter_index(p.selected, p.block_tables, p.cu_seqlens_q, p.used_kv_lens,
                                   block_size=p.block_size, page_size=p.page_size, causal=p.causal)
    for f in INDEX_FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"R33: field {f} differs from the host index"


@given(data=st.data())
def test_R30_device_inputs_give_device_outputs_with_the_same_bits(backend, data):
    if not _has_device(backend) or not hasattr(backend, "asarray"):
        pytest.skip(f"backend {backend.name!r} has no device arrays")
    p = _problem(data, backend)
    k, v = _caches(backend, p.k_cache, p.v_cache)
    q32 = p.q.astype(np.float32)  # widening is exact (R7): the host call sees the same values
    host = psa.forward(q32, k, v, p.block_tables, p.selected, p.cu_seqlens_q, used_kv_lens=p.used_kv_lens,
                       block_size=p.block_size, softmax_scale=p.softmax_scale, causal=p.causal, backend=backend,
                       return_lse=True)
    qd, sd = backend.asarray(q32), backend.asarray(p.selected)
    dev = psa.forward(qd, k, v, p.block_tables, sd, p.cu_seqlens_q, used_kv_lens=p.used_kv_lens,
                      block_size=p.block_size, softmax_scale=p.softmax_scale, causal=p.causal, return_lse=True)
    assert all(isinstance(x, psa.DeviceArray) for x in dev), "R30: device inputs must give device outputs"
    assert dev[0].shape == host[0].shape and dev[1].shape == host[1].shape
    assert _bits([_host(x) for x in dev], host), "R30: device-resident results differ from the host call"
    np.testing.assert_array_equal(sd.numpy(), p.selected)


@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_R30_host_outputs_held_across_calls_keep_their_values(backend, data, seed):
    """R30: host results are the caller's: the results of nine calls, all held (and a view of the
    first), are unchanged by the calls after them; each equals the same call made again."""
    p = _problem(data, backend)
    rng = np.random.default_rng(seed)
    k, v = _caches(backend, p.k_cache, p.v_cache)
    qs = [p.q] + [rng.standard_normal(p.q.shape).astype(p.q.dtype) for _ in range(8)]

    def call(q):
        return psa.forward(q, k, v, p.block_tables, p.selected, p.cu_seqlens_q, used_kv_lens=p.used_kv_lens,
                           block_size=p.block_size, softmax_scale=p.softmax_scale, causal=p.causal,
                           backend=backend, return_lse=True)

    held = [call(q) for q in qs]
    view = held[0][0][::-1]
    first = [held[0][0].copy(), held[0][1].copy()]
    del held[0]
    for q, got in zip(qs[1:], held):
        assert _bits(got, call(q)), "R30: a held result changed, or the same call gave other bits"
    assert view[::-1].tobytes() == first[0].tobytes(), "R30: a view of a dropped result was written over"
    assert _bits(call(qs[0]), first)


@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_R7_a_float16_q_gives_the_bits_of_q_widened_by_numpy(backend, data, seed):
    """R7: a backend computes with q widened exactly to float32, wherever it widens it (a backend
    may take a float16 q as it is and widen it on its device): forward() and plan.run() with a
    float16 q, host or device-resident, give the bits of the same calls on q.astype(float32).
    The q holds subnormal and signed-zero halves besides the problem's values."""
    p = _problem(data, backend)
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        q16 = p.q.astype(np.float16)  # (values beyond float16's range become inf: valid R7 inputs too)
    bits = q16.reshape(-1).view(np.uint16)
    special = rng.random(bits.size) < 0.25
    bits[special] = rng.integers(0, 0x400, int(special.sum())) | (rng.integers(0, 2, int(special.sum())) << 15)
    q32 = q16.astype(np.float32)
    k, v = _caches(backend, p.k_cache, p.v_cache)
    kw = dict(used_kv_lens=p.used_kv_lens, block_size=p.block_size, softmax_scale=p.softmax_scale, causal=p.causal,
              backend=backend, return_lse=True)
    # the float16 calls first, each plan fresh: a widening that did not happen cannot pass for one
    # that did by leaving an earlier call's float32 q in place
    got = psa.forward(q16, k, v, p.block_tables, p.selected, p.cu_seqlens_q, **kw)
    run = _plan(backend, p).run(q16, k, v, p.selected, return_lse=True)
    dev = None
    if _has_device(backend) and hasattr(backend, "asarray"):
        dev = _plan(backend, p).run(backend.asarray(q16), k, v, backend.asarray(p.selected), return_lse=True)
    want = psa.forward(q32, k, v, p.block_tables, p.selected, p.cu_seqlens_q, **kw)
    assert _bits(got, want), "R7: forward() with a float16 q differs from forward() with it widened by numpy"
    assert _bits(run, want), "R7: plan.run() with a float16 q differs from forward() with it widened by numpy"
    if dev is not None:
        assert _bits([_host(x) for x in dev], want), \
            "R7: plan.run() with a device-resident float16 q differs from forward() with it widened by numpy"


@given(data=st.data(), kind=st.sampled_from(["repeat", "above", "below"]))
def test_R31_a_device_selection_that_breaks_R6_raises_when_results_reach_the_host(backend, data, kind):
    if not _has_device(backend) or not hasattr(backend, "asarray"):
        pytest.skip(f"backend {backend.name!r} has no device arrays")
    p = _problem(data, backend, topk=st.integers(2, 4), num_kv_heads=1)
    if p.num_queries == 0:
        return
    sel = p.selected.copy()
    t = data.draw(st.integers(0, p.num_queries - 1), label="row")
    sel[t, 0, :2] = {"repeat": (0, 0), "above": (p.msb, -1), "below": (-2, -1)}[kind]
    k, v = _caches(backend, p.k_cache, p.v_cache)
    plan = _plan(backend, p)
    with pytest.raises(psa.SpecError, match=r"\[R6\]"):
        out = plan.run(backend.asarray(p.q.astype(np.float32)), k, v, backend.asarray(sel))
        out.numpy()
    with pytest.raises(psa.SpecError, match=r"\[R6\]"):  # host q: the call itself reads the results
        plan.run(p.q, k, v, backend.asarray(sel))
    with pytest.raises(psa.SpecError, match=r"\[R6\]"):  # the inversion alone (R33) checks it too
        plan.kvouter_index(backend.asarray(sel))
    # a violation belongs to its call: the same plan's next calls on a valid selection read fine
    q32 = p.q.astype(np.float32)
    want = plan.run(q32, k, v, p.selected, return_lse=True)
    got = plan.run(backend.asarray(q32), k, v, backend.asarray(p.selected), return_lse=True)
    assert _bits([x.numpy() for x in got], want), "R31: a valid call after a violation differs or raised"


@given(data=st.data(), seed=st.integers(0, 2**32 - 1), d_idx=st.sampled_from([4, 8, 3]),
       shared=st.booleans())
def test_R32_run_sparse_equals_the_index_branch_then_forward(backend, data, seed, d_idx, shared):
    """The whole MSA layer of a plan equals block_scores -> select_topk -> forward on the backend."""
    if not getattr(backend.capabilities, "index_branch", type(backend).block_scores is not psa.Backend.block_scores):
        pytest.skip(f"backend {backend.name!r} declares no index branch")
    p = _problem(data, backend, topk=st.integers(1, 3))
    if p.num_queries == 0:
        return
    rng = np.random.default_rng(seed)
    hk = 1 if shared else p.num_kv_heads
    dt = p.k_cache.dtype
    iq = rng.standard_normal((p.num_queries, p.num_kv_heads, d_idx)).astype(dt)
    ik = rng.standard_normal((p.num_pages, hk, p.page_size, d_idx)).astype(dt)
    k, v = _caches(backend, p.k_cache, p.v_cache)
    ikd = backend.upload_index_cache(ik) if _has_device(backend) and hasattr(backend, "upload_index_cache") else ik
    K = p.selected.shape[2]
    plan = _plan(backend, p, index_dim=d_idx, num_index_heads=hk, index_dtype=dt)
    got = plan.run_sparse(p.q, k, v, iq, ikd, return_lse=True)
    scores = psa.block_scores(iq, ikd, p.block_tables, p.cu_seqlens_q, p.used_kv_lens, block_size=p.block_size,
                              causal=p.causal, backend=backend)
    sel = psa.select_topk(scores, K, cu_seqlens_q=p.cu_seqlens_q, used_kv_lens=p.used_kv_lens,
                          block_size=p.block_size, backend=backend)
    want = psa.forward(p.q, k, v, p.block_tables, sel, p.cu_seqlens_q, used_kv_lens=p.used_kv_lens,
                       block_size=p.block_size, softmax_scale=p.softmax_scale, causal=p.causal, backend=backend,
                       return_lse=True)
    assert _bits(got, want), "R32: plan.run_sparse() differs from block_scores -> select_topk -> forward"


@given(data=st.data())
def test_R35_synchronize_waits_without_reading_back_or_raising_R6(backend, data):
    """``synchronize()`` returns with the runs done and copies nothing: a device selection that
    breaks R6 raises at the first readback after it (R31), not in it; results read after it are
    the call's."""
    assert backend.synchronize() is None  # every backend has it (a host backend: nothing to wait for)
    if not _has_device(backend) or not hasattr(backend, "asarray"):
        return
    p = _problem(data, backend, topk=st.integers(2, 4), num_kv_heads=1)
    if p.num_queries == 0:
        return
    k, v = _caches(backend, p.k_cache, p.v_cache)
    plan = _plan(backend, p)
    q = backend.asarray(p.q.astype(np.float32))
    good = plan.run(q, k, v, backend.asarray(p.selected), return_lse=True)
    sel = p.selected.copy()
    sel[data.draw(st.integers(0, p.num_queries - 1), label="row"), 0, :2] = (0, 0)  # a repeated id
    bad = plan.run(q, k, v, backend.asarray(sel))
    plan.synchronize()  # no R6 here: nothing reached the host
    backend.synchronize()
    with pytest.raises(psa.SpecError, match=r"\[R6\]"):
        bad.numpy()
    want = plan.run(p.q.astype(np.float32), k, v, p.selected, return_lse=True)
    assert _bits([x.numpy() for x in good], want), "R35: results read after synchronize() differ from the call's"


@given(data=st.data())
def test_R36_runs_issued_back_to_back_equal_runs_read_one_by_one(backend, data):
    """A backend may submit several runs together (R36): more runs on device arrays than a batch
    holds, issued back to back and read afterwards, equal the same runs with host inputs, each
    read at once (bit for bit, out and lse)."""
    if not _has_device(backend) or not hasattr(backend, "asarray"):
        return
    p = _problem(data, backend)
    k, v = _caches(backend, p.k_cache, p.v_cache)
    plan = _plan(backend, p)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    qs = [rng.standard_normal(p.q.shape).astype(np.float32) for _ in range(9)]
    qd = [backend.asarray(q) for q in qs]  # (uploads first: a host write submits what is recorded)
    sd = backend.asarray(p.selected)
    outs = [plan.run(x, k, v, sd, return_lse=True) for x in qd]
    for q, got in zip(qs, outs):
        want = plan.run(q, k, v, p.selected, return_lse=True)
        assert _bits([_host(x) for x in got], want), "R36: a run recorded with others differs from the run alone"
