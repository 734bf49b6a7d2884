"""Pinned host memory of a plan (``backends/wgpu/_host_io.py``): result blocks lent to the caller
must never be written while an array over them lives, and must come back when none does.

The lending is checked with a stand-in for the runtime's host-memory functions (Dawn's Null
adapter cannot make buffers over host memory: its alignment limit is undefined), the whole call
on a backend whose device maps host memory (``dawn`` on a GPU; skipped, with the reason,
elsewhere).
"""

from __future__ import annotations

import gc
import mmap
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn import _attention_plan
from paged_sparse_attn.backends.wgpu import _host_io
from paged_sparse_attn.testing import assert_attention_close
from paged_sparse_attn.testing.generate import random_problem


class _Memory:
    """What ``HostIO`` calls of the runtime's host-memory module: pages, and a buffer record."""

    @staticmethod
    def allocate_host_memory(device, size):
        return memoryview(mmap.mmap(-1, -(-size // 4096) * 4096))

    @staticmethod
    def create_buffer_from_host_memory(device, mem, *, usage, label=""):
        return SimpleNamespace(mem=mem, usage=usage, label=label)


_ROOMY = _host_io.PinnedAccount(1 << 40)  # (an account that never refuses)


@pytest.fixture
def null_io():
    """A ``HostIO`` of 4 KiB result blocks, on stand-in memory."""
    runtime = SimpleNamespace(host_memory_module=lambda: _Memory)
    ctx = SimpleNamespace(runtime=runtime, device=None, host_memory=True)
    owner: list = []
    return _host_io.HostIO(ctx, 4096, owner, _host_io.PinnedAccount(1 << 30)), owner


def test_a_lent_block_is_not_reused_while_any_view_of_its_array_lives(null_io):
    io, owner = null_io
    blocks = [io.take() for _ in range(_host_io.LEND)]
    assert all(b.lent for b in blocks) and len({id(b) for b in blocks}) == _host_io.LEND
    assert io.take() is io.own  # all lent: the plan's own block (its results are copied)
    for i, b in enumerate(blocks):
        b.bytes[:64].view(np.float32)[:] = i  # what the GPU would have written
    outs = [io.out(b, 64, (4, 4)) for b in blocks]
    assert all(np.shares_memory(o, b.bytes) for o, b in zip(outs, blocks))  # no copy
    view = outs[0][1:].T  # a view outliving its array
    del outs[0]
    gc.collect()
    assert io.take() is io.own  # block 0 is still referred to
    del view
    gc.collect()
    assert io.take() is blocks[0]  # back once nothing refers to it
    io.put(blocks[0])
    own = io.out(io.own, 64, (4, 4))
    assert not np.shares_memory(own, io.own.bytes)  # the own block's results are copied
    io.put(io.own)
    assert io.take() is blocks[0]  # (put ignores the own block)
    assert len(owner) == 1 + _host_io.LEND  # own block, lendable blocks


def test_memory_the_device_refuses_gives_none_and_says_why():
    """A device that offers host memory but refuses it: no HostIO (the plan's other transport),
    and a warning naming the runtime's reason."""

    class Refusing(_Memory):
        @staticmethod
        def create_buffer_from_host_memory(device, mem, *, usage, label=""):
            raise ValueError("The address and size of the memory must be multiples of 4096")

    ctx = SimpleNamespace(runtime=SimpleNamespace(host_memory_module=lambda: Refusing), device=None, host_memory=True)
    with pytest.warns(RuntimeWarning, match="refused them .*multiples of 4096.*reads its results back"):
        assert _host_io.host_io(ctx, 64, [], _ROOMY) is None
    with pytest.warns(RuntimeWarning, match="refused them .*multiples of 4096.*writes its queries with write_buffer"):
        assert _host_io.host_input(ctx, _host_io.INPUT_MIN_BYTES, [], _ROOMY) is None


def test_plans_too_large_for_the_limit_get_none():
    ctx = SimpleNamespace(host_memory=True)
    assert _host_io.host_io(ctx, _host_io.HOST_IO_MAX_BLOCK + 1, [], _ROOMY) is None
    assert _host_io.host_io(SimpleNamespace(host_memory=False), 16, [], _ROOMY) is None


def test_large_blocks_are_lent_two_at_a_time():
    """Blocks too large for LEND of them and the plan's own within HOST_IO_BYTES: two are lent at
    a time (a loop ``out = forward(...)`` holds the last call's out during the next call: both
    calls lend), and the plan's own block is made only when a call needs it."""
    small = _host_io.HOST_IO_BYTES // (1 + _host_io.LEND)
    assert _host_io.lendable(small) == _host_io.LEND
    assert _host_io.lendable(small + 4096) == 2
    assert _host_io.lendable(_host_io.HOST_IO_MAX_BLOCK) == 2
    assert _host_io.lendable(_host_io.HOST_IO_MAX_BLOCK + 1) == 0
    ctx = SimpleNamespace(runtime=SimpleNamespace(host_memory_module=lambda: _Memory), device=None, host_memory=True)
    owner: list = []
    io = _host_io.host_io(ctx, small + 4096, owner, _host_io.PinnedAccount(1 << 30))
    assert io is not None and io.lend == 2 and len(owner) == 1  # one lendable block, no own block yet
    out = None
    for _ in range(6):  # the loop: the last out alive while the next call takes its block
        block = io.take()
        assert block.lent
        out = io.out(block, 64, (4, 4))
        gc.collect()
    assert len(owner) == 2  # two lendable blocks, never the own one
    held = out
    second = io.take()
    assert second.lent
    kept = io.out(second, 64, (4, 4))
    assert io.take() is io.own and len(owner) == 3  # both lent blocks held: the own block, made now
    del held, out, kept
    gc.collect()
    assert io.take().lent and len(owner) == 3  # back; nothing more made


def test_large_host_queries_get_an_input_block_and_small_ones_none():
    """A host q of INPUT_MIN_BYTES or more (up to HOST_IO_MAX_BLOCK) gets the plan's pinned input
    block, which holds the array's bytes once written; smaller ones are written by the queue."""
    ctx = SimpleNamespace(runtime=SimpleNamespace(host_memory_module=lambda: _Memory), device=None, host_memory=True)
    owner: list = []
    assert _host_io.host_input(ctx, _host_io.INPUT_MIN_BYTES - 4, owner, _ROOMY) is None
    assert _host_io.host_input(ctx, _host_io.HOST_IO_MAX_BLOCK + 4, owner, _ROOMY) is None
    assert _host_io.host_input(SimpleNamespace(host_memory=False), _host_io.INPUT_MIN_BYTES, owner, _ROOMY) is None
    assert owner == []
    blk = _host_io.host_input(ctx, _host_io.INPUT_MIN_BYTES, owner, _ROOMY)
    assert blk is not None and owner == [blk.buffer]
    q = np.random.default_rng(0).standard_normal(_host_io.INPUT_MIN_BYTES // 4, dtype=np.float32).reshape(-1, 64)
    blk.write(q)
    assert blk.bytes[:q.nbytes].view(np.float32).reshape(q.shape).tobytes() == q.tobytes()


@pytest.mark.parametrize("nbytes", [1, 4095, 3 * 4096 + 7, 64 * 4096])
def test_large_copies_into_pinned_memory_in_slices_by_threads_copy_every_byte(monkeypatch, nbytes):
    """``copy_in`` with its threshold lowered so that these sizes go in page-aligned slices by
    threads (where the host has two CPUs or more): every byte, and nothing past the end."""
    monkeypatch.setattr(_host_io, "COPY_MIN_BYTES", 1)
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 64, np.uint8)
    _host_io.copy_in(dst[:nbytes], src)
    assert dst[:nbytes].tobytes() == src.tobytes() and not dst[nbytes:].any()


def test_pinned_blocks_count_against_the_backends_limit_and_go_back_when_collected():
    """Every pinned block is counted (whole pages) in the backend's account while it lives; a
    block with no room is not made: the first result block (no HostIO), a later one (``take``
    gives another free block, else None: the call reads back through a mapped buffer), an input
    block (None: ``write_buffer``), all without a warning. Collected blocks give their pages back,
    a lent one only when the last array over it is gone."""
    ctx = SimpleNamespace(runtime=SimpleNamespace(host_memory_module=lambda: _Memory), device=None, host_memory=True)
    acct = _host_io.PinnedAccount(2 * 8192)
    io = _host_io.host_io(ctx, 5000, [], acct)  # blocks of two pages
    assert io is not None and acct.used == 8192
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a limit the backend was given says nothing)
        assert _host_io.host_io(ctx, 5000, [], _host_io.PinnedAccount(4096)) is None
        assert _host_io.host_input(ctx, _host_io.INPUT_MIN_BYTES, [], acct) is None
    a = io.take()
    out_a = io.out(a, 64, (4, 4))
    b = io.take()  # the second lendable block fills the account
    assert b.lent and b is not a and acct.used == 2 * 8192
    out_b = io.out(b, 64, (4, 4))
    assert io.take() is None  # both lent, no room for a third or the own block
    del out_b
    gc.collect()
    assert io.take() is b  # a free block needs no room
    io.put(b)
    del io, a, b
    gc.collect()
    assert acct.used == 8192  # the lent block a lives on under out_a
    del out_a
    gc.collect()
    assert acct.used == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_max_host_bytes_must_be_an_int_of_zero_or_more(WgpuBackend, bad):
    with pytest.raises(ValueError, match="max_host_bytes must be an int >= 0"):
        WgpuBackend(max_host_bytes=bad)


def _decode_problem():
    """Three one-query sequences on float16 caches (a decode call's shape, small)."""
    return random_problem(3, seqlens_q=(1, 1, 1), Hkv=2, G=4, D=32, page_size=8, ppb=2, msb=4, causal=True,
                          dtype=np.float16, q_dtype=np.float32, poison=False)


def _each_correct_and_repeatable(backend, pb, k, v, qs, got) -> None:
    """Each call's ``(out, lse)`` in ``got`` equal to the reference for its ``q``, and the first
    call's bits again when its ``q`` comes back."""
    for q, (out, lse) in zip(qs, got):
        ref, ref_lse = psa.dense_reference(q, *pb.args[1:], **pb.options)
        assert_attention_close(out, ref, dtype=np.float16, lse=lse, ref_lse=ref_lse)
    again = psa.forward(qs[0], k, v, *pb.args[3:], **pb.options, backend=backend, return_lse=True)
    assert again[0].tobytes() == got[0][0].tobytes() and again[1].tobytes() == got[0][1].tobytes()


@pytest.mark.psa_backends(exclude=("numpy",))
def test_results_held_across_calls_stay_intact(backend):
    """Decode calls with host arrays: the results of more calls than a plan lends blocks of host
    memory, all held at once, each equal to its own reference afterwards (on a device that maps
    host memory the plan lends them; elsewhere each call copies out of its readback buffer)."""
    pb = _decode_problem()
    k, v = backend.upload_kv_cache(pb.k_cache, pb.v_cache)
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal(pb.q.shape, dtype=np.float32) for _ in range(2 * _host_io.LEND + 1)]
    held = [psa.forward(q, k, v, *pb.args[3:], **pb.options, backend=backend, return_lse=True) for q in qs]
    plans = [p for p, *_ in _attention_plan._cache.values() if p.backend is backend]
    assert plans
    lent = any(getattr(p._runtime, "hio", None) is not None for p in plans)
    assert lent == backend.device_context.host_memory
    if lent:
        assert all(not out.flags.owndata for out, _ in held[:_host_io.LEND])  # over the blocks: no copies
    _each_correct_and_repeatable(backend, pb, k, v, qs, held)


@pytest.mark.psa_backends(exclude=("numpy",))
@pytest.mark.parametrize("q_dtype", [np.float32, np.float16])
def test_queries_through_the_input_block_give_each_call_its_own_results(backend, monkeypatch, q_dtype):
    """Prefill calls with a host q through the plan's pinned input block (the size threshold
    lowered so that a small problem takes it, on a device that maps host memory; elsewhere q is
    written by the queue), float32 and float16 (widened on the device from the block's copy):
    calls in turn with different queries, each equal to its reference, the first call's results
    again when its q comes back."""
    monkeypatch.setattr(_host_io, "INPUT_MIN_BYTES", 64)
    pb = random_problem(5, seqlens_q=(7, 9), Hkv=2, G=2, D=32, page_size=8, ppb=2, msb=4, causal=True,
                        dtype=np.float16, q_dtype=np.float32, poison=False)
    k, v = backend.upload_kv_cache(pb.k_cache, pb.v_cache)
    rng = np.random.default_rng(1)
    qs = [rng.standard_normal(pb.q.shape, dtype=np.float32).astype(q_dtype) for _ in range(3)]
    got = [psa.forward(q, k, v, *pb.args[3:], **pb.options, backend=backend, return_lse=True) for q in qs]
    rts = [p._runtime for p, *_ in _attention_plan._cache.values() if p.backend is backend]
    assert any(getattr(r, "hin", None) is not None for r in rts) == backend.device_context.host_memory
    _each_correct_and_repeatable(backend, pb, k, v, qs, got)


@pytest.mark.psa_backends(exclude=("numpy",))
def test_a_backends_plans_hold_no_more_pinned_memory_than_it_allows(backend):
    """Backends of the same kind with room for no pinned block and for two: calls whose results
    are all held read back through a mapped buffer where there is no room, each result the same
    bits as the given backend's; the pinned memory never exceeds the limit (none at 0), and it
    is all back once the backend is closed (which closes its cached plans) and the results are
    dropped."""
    from paged_sparse_attn.backends.wgpu._tensors import CallResult

    pb = _decode_problem()
    rng = np.random.default_rng(2)
    qs = [rng.standard_normal(pb.q.shape, dtype=np.float32) for _ in range(_host_io.LEND + 2)]
    k, v = backend.upload_kv_cache(pb.k_cache, pb.v_cache)
    want = [psa.forward(q, k, v, *pb.args[3:], **pb.options, backend=backend, return_lse=True) for q in qs]
    block = -(-CallResult.nbytes(*pb.q.shape) // _host_io.PAGE) * _host_io.PAGE
    for limit in (0, 2 * block):
        be = type(backend)(max_host_bytes=limit)
        kb, vb = be.upload_kv_cache(pb.k_cache, pb.v_cache)
        held = []
        for q in qs:
            held.append(psa.forward(q, kb, vb, *pb.args[3:], **pb.options, backend=be, return_lse=True))
            assert be._pinned.used <= limit
        if be.device_context.host_memory:
            assert be._pinned.used == limit  # (the room is used: two blocks lent, then no more)
        for (out, lse), (w_out, w_lse) in zip(held, want):
            assert out.tobytes() == w_out.tobytes() and lse.tobytes() == w_lse.tobytes()
        be.close()
        assert not any(p.backend is be for p, *_ in _attention_plan._cache.values())
        del held, out, lse
        gc.collect()
        assert be._pinned.used == 0


def test_a_spinning_wait_returns_after_the_submitted_work_on_a_runtime_that_cannot_poll(WgpuBackend):
    """wgpu-native cannot poll without blocking: ``wait_queue_spinning`` waits as ``wait_queue``
    does, and the work submitted before it is done when it returns."""
    from paged_sparse_attn.backends.wgpu._transfer import wait_queue_spinning
    from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage

    be = WgpuBackend()
    try:
        ctx = be.device_context
        assert ctx.runtime.poll_work_done is None and not ctx.host_memory
        dev = ctx.device
        src = dev.create_buffer_with_data(data=np.arange(64, dtype=np.uint32), usage=BufferUsage.COPY_SRC)
        rb = dev.create_buffer(size=256, usage=BufferUsage.MAP_READ | BufferUsage.COPY_DST)
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, rb, 0, 256)
        dev.queue.submit([enc.finish()])
        wait_queue_spinning(ctx)
        rb.map_sync(1)  # (done: maps at once)
        assert np.frombuffer(rb.read_mapped(), np.uint32).tolist() == list(range(64))
        rb.unmap()
    finally:
        be.close()


def test_a_calls_large_inputs_keep_their_pinned_block_per_label_and_grow_it():
    """``call_input``: one block per (label, slot), reused by the next call that fits it, made anew
    (the old buffer destroyed) for a larger input; None where the device maps no host memory or
    the input is below ``INPUT_MIN_BYTES``, and nothing is kept then."""
    destroyed = []

    class _Buffers(_Memory):
        @staticmethod
        def create_buffer_from_host_memory(device, mem, *, usage, label=""):
            return SimpleNamespace(mem=mem, usage=usage, label=label, destroy=lambda: destroyed.append(label))

    ctx = SimpleNamespace(runtime=SimpleNamespace(host_memory_module=lambda: _Buffers), device=None, host_memory=True,
                          host_inputs={})
    n = _host_io.INPUT_MIN_BYTES
    a = _host_io.call_input(ctx, ("scores", 0), n, _ROOMY)
    assert a is not None and _host_io.call_input(ctx, ("scores", 0), n - 4096, _ROOMY) is a
    b = _host_io.call_input(ctx, ("index_q", 0), n, _ROOMY)
    assert b is not None and b is not a and set(ctx.host_inputs) == {("scores", 0), ("index_q", 0)}
    c = _host_io.call_input(ctx, ("scores", 0), 2 * n, _ROOMY)
    assert c is not a and c.bytes.nbytes >= 2 * n and destroyed == ["scores.pinned"]
    assert ctx.host_inputs[("scores", 0)] is c
    assert _host_io.call_input(ctx, ("small", 0), n - 4, _ROOMY) is None and ("small", 0) not in ctx.host_inputs
    off = SimpleNamespace(host_memory=False, host_inputs={})
    assert _host_io.call_input(off, ("scores", 0), n, _ROOMY) is None and off.host_inputs == {}


@pytest.mark.psa_backends(exclude=("numpy",))
def test_index_branch_inputs_through_pinned_memory_give_the_bits_of_queue_writes(backend, monkeypatch):
    """``block_scores()`` and ``select_topk()`` with every host input through the device's pinned
    memory (the size threshold lowered, on a device that maps host memory; elsewhere written by
    the queue): calls in turn with different index queries and scores, each with the bits of the
    same call written by the queue, the blocks kept for the next call."""
    from paged_sparse_attn.bench.index_branch import _problem

    p = _problem(2048, 64)
    rng = np.random.default_rng(3)
    iqs = [p["index_q"], rng.standard_normal(p["index_q"].shape, dtype=np.float32)]

    def both(iq):
        sc = psa.block_scores(iq, p["index_k_cache"], p["block_tables"], p["cu_seqlens_q"], p["used_kv_lens"],
                              block_size=p["block_size"], backend=backend)
        sel = psa.select_topk(sc, 4, cu_seqlens_q=p["cu_seqlens_q"], used_kv_lens=p["used_kv_lens"],
                              block_size=p["block_size"], backend=backend)
        return sc, sel

    queued = [both(iq) for iq in iqs]
    monkeypatch.setattr(_host_io, "INPUT_MIN_BYTES", 64)
    pinned = [both(iq) for iq in iqs + iqs]
    ctx = backend.device_context
    assert bool(ctx.host_inputs) == ctx.host_memory
    for (sc, sel), (sc2, sel2) in zip(queued + queued, pinned):
        assert sc2.tobytes() == sc.tobytes() and sel2.tobytes() == sel.tobytes()
    assert queued[0][0].tobytes() != queued[1][0].tobytes()  # the two calls differ: a stale input would show
