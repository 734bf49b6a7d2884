"""Reliability of the wgpu backend: oversize problems, device errors and device loss, threads,
and a long run of mixed calls.

* Oversize: a problem whose buffers cannot fit a binding, or the device memory the backend may
  use (``max_device_bytes``), is refused with UnsupportedError (R18) that gives the bytes
  needed and available, before anything is allocated (a spy traps every allocation).
* Device errors: validation errors, out-of-memory and device loss surface as DeviceError with
  the kernel and the sizes; nothing allocated by the failed call is left behind; the backend
  works afterwards (on a new device after a loss).
* Threads: 8 threads share one backend and get the bits a single thread gets (R19).
* Soak: 500 calls of random small problems alternating numpy and wgpu keep the live wgpu
  buffers, the compiled pipelines and the process memory bounded.

These tests require the backend (CI installs lavapipe); a missing driver is a failure.
"""

from __future__ import annotations

import contextlib
import gc
import re
import threading
import time

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn._resources import peak_rss_bytes, rss_bytes, wgpu_object_counts
from paged_sparse_attn.errors import DeviceError, UnsupportedError
from paged_sparse_attn.testing.assertions import Tolerance, assert_attention_close, tolerance

from paged_sparse_attn.testing.generate import random_problem
from test_reliability import no_device_work


@pytest.fixture(scope="module")
def be(WgpuBackend):
    b = WgpuBackend(required_limits="default")
    yield b
    b.close()


def live_buffers() -> int:
    """wgpu buffers alive in this process (Python objects; freed ones are collected first)."""
    gc.collect()
    return wgpu_object_counts().get("Buffer", 0)


class Allocations:
    """Buffers created (and destroyed) inside an :func:`allocations` block."""

    def __init__(self):
        self.made: list = []
        self.destroyed: set = set()

    @property
    def sizes(self) -> list[int]:
        return [int(b.size) for b in self.made]

    def left_behind(self, backend) -> list:
        """Buffers made in the block, not destroyed, and not kept by ``backend`` on purpose (its
        scratch and per-call buffer pool, reused by the next call)."""
        ctx = backend.device_context
        kept = set()
        if ctx is not None:
            kept = {id(b) for b in list(ctx.pool.values()) + list(ctx.scratch or ())}
        return [b for b in self.made if id(b) not in self.destroyed and id(b) not in kept]


@contextlib.contextmanager
def allocations(fail_after: int | None = None, error=None):
    """Record every buffer created and destroyed inside the block; with ``fail_after``,
    creation number ``fail_after`` (0-based) and later ones raise ``error()`` instead (the
    backend's 16-byte device-loss probe, label "probe", is let through)."""
    from wgpu.backends import wgpu_native

    dev_cls, buf_cls = wgpu_native.GPUDevice, wgpu_native.GPUBuffer
    old_create, old_destroy = dev_cls.__dict__["create_buffer"], buf_cls.__dict__["destroy"]
    rec = Allocations()

    def create_buffer(self, *args, **kwargs):
        probe = kwargs.get("label") == "probe"
        if fail_after is not None and not probe and len(rec.made) >= fail_after:
            raise error()
        b = old_create(self, *args, **kwargs)
        if not probe:
            rec.made.append(b)
        return b

    def destroy(self):
        rec.destroyed.add(id(self))
        return old_destroy(self)

    dev_cls.create_buffer, buf_cls.destroy = create_buffer, destroy
    try:
        yield rec
    finally:
        dev_cls.create_buffer, buf_cls.destroy = old_create, old_destroy


def check_result(pb, out, lse=None):
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    assert_attention_close(out, ref, dtype=pb.k_cache.dtype, lse=lse, ref_lse=None if lse is None else ref_lse)


def _bytes(msg: str, pattern: str) -> int:
    m = re.search(pattern, msg)
    assert m, f"the message must match {pattern!r}: {msg}"
    return int(m.group(1))


# --- oversize problems ---------------------------------------------------------------------------

def test_R18_a_page_larger_than_a_binding_is_refused_before_allocation(WgpuBackend):
    """One (page, KV head) slab of 8 x 16 floats = 512 bytes cannot be split below a binding."""
    small = WgpuBackend(required_limits="default", max_binding_size=256)
    pb = random_problem(1, seqlens_q=(2,), Hkv=1, G=1, D=16, page_size=8, ppb=1, msb=2, poison=False)
    with no_device_work(methods=()) as hits:
        for call in (lambda: psa.forward(*pb.args, **pb.options, backend=small),
                     lambda: small.upload_kv_cache(pb.k_cache, pb.v_cache)):
            with pytest.raises(UnsupportedError, match=r"takes 512 bytes, more than the storage binding limit 256"):
                call()
    assert not hits, f"{hits[0]} ran before the refusal"
    small.close()


def test_R18_a_row_too_big_for_one_binding_is_refused_before_allocation(WgpuBackend):
    """Bindings of 2048 bytes hold 64 partial rows of D=8; one query reading 10 blocks with G=8
    heads needs 80: no split can help, so the call is refused, naming bytes needed and available."""
    small = WgpuBackend(required_limits="default", max_binding_size=2048)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 8)).astype(np.float32)
    k = rng.standard_normal((16, 1, 1, 8)).astype(np.float32)
    bt = np.arange(16, dtype=np.int32)[None]
    sel = np.arange(10, dtype=np.int32)[None, None]
    args = (q, k, k, bt, sel, np.array([0, 1]))
    with no_device_work(methods=()) as hits, pytest.raises(UnsupportedError) as info:
        psa.forward(*args, block_size=1, backend=small)
    assert not hits, f"{hits[0]} ran before the refusal"
    msg = str(info.value)
    need = _bytes(msg, r"80 partial rows = (\d+) bytes")
    avail = _bytes(msg, r"at most (\d+) bytes fit")
    assert need == 80 * 8 * 4 and avail == 64 * 8 * 4 and msg.endswith("[R18]"), msg
    out = psa.forward(*args, block_size=1, backend="numpy")  # the problem itself is valid
    assert np.isfinite(out).all()
    small.close()


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_R18_max_device_bytes_refuses_before_allocation_with_bytes_needed_and_available(WgpuBackend, shape):
    """The budget check announces what the call will allocate, to the byte, for either partials
    kernel (decode-shaped calls, one query per sequence, may run a specialised one)."""
    seqlens, G = ((3, 2), 2) if shape == "prefill" else ((1, 1, 1), 4)
    pb = random_problem(2, seqlens_q=seqlens, G=G, D=8, poison=False)
    tiny = WgpuBackend(required_limits="default", max_device_bytes=1)
    with no_device_work(methods=()) as hits, pytest.raises(UnsupportedError) as info:
        psa.forward(*pb.args, **pb.options, backend=tiny)
    assert not hits, f"{hits[0]} ran before the refusal"
    msg = str(info.value)
    need = _bytes(msg, r"needs (\d+) bytes of device memory")
    assert _bytes(msg, r"(\d+) bytes are available") == 1 and "nothing was allocated" in msg, msg
    tiny.close()

    # exactly enough: the call runs, and allocates exactly what it announced
    exact = WgpuBackend(required_limits="default", max_device_bytes=need)
    with allocations() as rec:
        out = psa.forward(*pb.args, **pb.options, backend=exact)
    check_result(pb, out)
    assert sum(rec.sizes) == need, f"announced {need} bytes, allocated {sum(rec.sizes)}: {rec.sizes}"
    # the scratch stays held: the next identical call needs (and has) the rest
    out2 = psa.forward(*pb.args, **pb.options, backend=exact)
    assert out2.tobytes() == out.tobytes()
    exact.close()
    short = WgpuBackend(required_limits="default", max_device_bytes=need - 1)
    with pytest.raises(UnsupportedError, match=rf"needs {need} bytes"):
        psa.forward(*pb.args, **pb.options, backend=short)
    short.close()


def _parts(msg: str) -> dict:
    """The byte counts by purpose in a max_device_bytes refusal ("cache upload 123, ...")."""
    inner = re.search(r"bytes of device memory \(([^)]*)\)", msg)
    assert inner, msg
    return {k.strip(): int(v) for k, v in re.findall(r"([a-z ]+?) (\d+)(?:,|$)", inner.group(1))}


def test_R18_max_device_bytes_counts_resident_caches(WgpuBackend):
    pb = random_problem(3, seqlens_q=(2, 2), D=8, poison=False)  # D = 8: no row padding on the device
    cache = 2 * max(16, pb.k_cache.nbytes)  # resident K and V
    probe = WgpuBackend(required_limits="default", max_device_bytes=1)
    with pytest.raises(UnsupportedError) as info:
        psa.forward(*pb.args, **pb.options, backend=probe)
    parts = _parts(str(info.value))
    probe.close()
    call = parts.get("call buffers", 0) + parts.get("scratch growth", 0)
    assert 0 < parts["cache upload"] < cache, parts  # host caches: only the pages the call reads

    be = WgpuBackend(required_limits="default", max_device_bytes=cache + call - 1)
    with no_device_work(methods=()) as hits, pytest.raises(UnsupportedError, match=r"upload_kv_cache\(\).*bytes are available"):
        be.upload_kv_cache(np.concatenate([pb.k_cache] * 2), np.concatenate([pb.v_cache] * 2))
    assert not hits, "a refused upload allocated"
    kd, vd = be.upload_kv_cache(pb.k_cache, pb.v_cache)  # fits
    # with the residents held, a call one byte short is refused, naming what they hold
    with no_device_work(methods=()) as hits, pytest.raises(
            UnsupportedError, match=rf"needs {call} bytes .* {call - 1} bytes are available .* {cache} held by resident"):
        psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=be)
    assert not hits, "a refused call allocated"
    kd.release()
    vd.release()
    out = psa.forward(*pb.args, **pb.options, backend=be)  # released: their memory is available again
    check_result(pb, out)
    be.close()


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "per-call-buffers"])
def test_an_allocation_failing_mid_call_leaves_nothing_behind(WgpuBackend, pooled):
    """Out of memory at the n-th allocation of a call, for every n: DeviceError naming the
    operation and its sizes; every buffer the call made is destroyed, except those the backend
    keeps on purpose (scratch and, without max_device_bytes, its per-call buffer pool); the
    next call gives the same bits."""
    import wgpu

    be = WgpuBackend(required_limits="default", max_device_bytes=None if pooled else 1 << 40)
    pb = random_problem(4, seqlens_q=(3, 1), D=8, poison=False)
    be.close()  # a fresh device for each n below: every allocation of a first call is reached
    with allocations() as rec:
        want = psa.forward(*pb.args, **pb.options, backend=be)
    n_alloc = len(rec.made)
    assert n_alloc >= 4 and not rec.left_behind(be), (n_alloc, rec.left_behind(be))
    oom = lambda: wgpu.GPUOutOfMemoryError("simulated out of memory")  # noqa: E731
    for n in range(n_alloc):
        be.close()
        with allocations(fail_after=n, error=oom) as rec, pytest.raises(DeviceError) as info:
            psa.forward(*pb.args, **pb.options, backend=be)
        msg = str(info.value)
        assert "failed (out of memory)" in msg and re.search(r"(bytes|D)=\d+", msg), f"no context: {msg}"
        assert len(rec.made) == n and not rec.left_behind(be), f"allocation {n} failed: buffers left behind"
        assert psa.forward(*pb.args, **pb.options, backend=be).tobytes() == want.tobytes()
    be.close()


# --- device errors and device loss ------------------------------------------------------------

def test_a_validation_error_in_pipeline_creation_is_a_DeviceError_and_the_backend_goes_on(be, monkeypatch):
    from paged_sparse_attn.backends.wgpu import _plan

    pb = random_problem(5, seqlens_q=(2, 2), D=8, poison=False)
    want = psa.forward(*pb.args, **pb.options, backend=be)
    orig = _plan.Geometry.constants
    monkeypatch.setattr(_plan.Geometry, "constants", lambda self: {**orig(self), "WG": 100000})  # no device has it
    with allocations() as rec, pytest.raises(DeviceError) as info:
        psa.forward(*pb.args, **pb.options, backend=be)
    msg = str(info.value)
    assert "pipeline creation of psa_partials.wgsl" in msg and "WG=100000" in msg and "D=8" in msg, msg
    monkeypatch.undo()
    assert not rec.left_behind(be), "the failed call left buffers behind"
    out = psa.forward(*pb.args, **pb.options, backend=be)
    assert out.tobytes() == want.tobytes()


def test_a_validation_error_at_submission_is_a_DeviceError_and_the_backend_goes_on(be, monkeypatch):
    """A dispatch beyond the device's limit (forced through the grid splitter) fails validation
    when the commands are encoded: DeviceError naming the kernels and sizes; nothing leaks."""
    from paged_sparse_attn.backends.wgpu import backend as wb

    pb = random_problem(6, seqlens_q=(2, 2), D=8, poison=False)
    want = psa.forward(*pb.args, **pb.options, backend=be)
    orig = wb.grid_dispatches
    monkeypatch.setattr(wb, "grid_dispatches", lambda n, m, **kw: ((f, c, 70000, gy) for f, c, gx, gy in orig(n, m, **kw)))
    with allocations() as rec, pytest.raises(DeviceError) as info:
        psa.forward(*pb.args, **pb.options, backend=be)
    msg = str(info.value)
    assert "forward (psa_partials.wgsl, psa_merge.wgsl) failed (GPUValidationError)" in msg and "D=8" in msg, msg
    assert "70000" in msg, msg
    monkeypatch.undo()
    assert not rec.left_behind(be), "the failed call left buffers behind"
    out = psa.forward(*pb.args, **pb.options, backend=be)
    assert out.tobytes() == want.tobytes()


def test_device_loss_is_survived_with_a_new_device(WgpuBackend):
    """After the device is lost (destroyed under the backend), the next call with host caches
    runs on a new device; resident caches died with the old one: DeviceError saying so, and the
    backend accepts a new upload."""
    lossy = WgpuBackend(required_limits="default")
    pb = random_problem(7, seqlens_q=(3, 2), D=8, poison=False)
    want, want_lse = psa.forward(*pb.args, **pb.options, backend=lossy, return_lse=True)
    ix = pb.build_index()
    want_p = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, ix, backend=lossy)

    old = lossy.device_context.device
    old.destroy()
    out, lse = psa.forward(*pb.args, **pb.options, backend=lossy, return_lse=True)
    assert lossy.device_context.device is not old, "the backend must have opened a new device"
    assert out.tobytes() == want.tobytes() and lse.tobytes() == want_lse.tobytes()

    lossy.device_context.device.destroy()
    got_p = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, ix, backend=lossy)
    assert got_p.o.tobytes() == want_p.o.tobytes() and got_p.l.tobytes() == want_p.l.tobytes()

    kd, vd = lossy.upload_kv_cache(pb.k_cache, pb.v_cache)
    lossy.device_context.device.destroy()
    with pytest.raises(DeviceError, match=r"lost"):
        psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=lossy)
    with pytest.raises(DeviceError, match=r"lost or closed; upload it again"):
        psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=lossy)
    kd, vd = lossy.upload_kv_cache(pb.k_cache, pb.v_cache)  # a new device takes the upload
    out = psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=lossy)
    assert out.tobytes() == want.tobytes()

    lossy.device_context.device.destroy()  # an upload to a lost device moves to a new one as well
    kd, vd = lossy.upload_kv_cache(pb.k_cache, pb.v_cache)
    assert psa.forward(pb.q, kd, vd, *pb.args[3:], **pb.options, backend=lossy).tobytes() == want.tobytes()
    lossy.close()


def test_the_pipeline_cache_is_bounded_least_recently_used_first():
    """A long run that meets many shapes keeps at most MAX_PIPELINES compiled pipelines (the
    soak below stays within one model's shapes; this is the bound for unbounded variety)."""
    from paged_sparse_attn.backends.wgpu._device import MAX_PIPELINES, PipelineCache

    cache = PipelineCache()
    for i in range(3 * MAX_PIPELINES):
        cache[("k", i)] = i
        assert cache.get(("k", 0)) == 0  # used on every call: never evicted
    assert len(cache) == MAX_PIPELINES and ("k", 0) in cache and ("k", 1) not in cache
    assert cache.get(("k", 3 * MAX_PIPELINES - 1)) == 3 * MAX_PIPELINES - 1 and cache.get("absent") is None


# --- threads ----------------------------------------------------------------------------------------

N_THREADS = 8


def _thread_problems():
    """One problem per thread, of different shapes (and so different pipelines)."""
    shapes = [dict(D=4), dict(D=8, G=1), dict(D=8, page_size=4, ppb=1), dict(D=16, Hkv=1, G=4),
              dict(D=8, dtype=np.float16), dict(D=4, causal=True), dict(D=12, msb=2), dict(D=8, seqlens_q=(4, 0, 2))]
    return [random_problem(100 + i, **{"seqlens_q": (3, 2), **s}, poison=True) for i, s in enumerate(shapes)]


def _run_threads(work, n: int):
    barrier = threading.Barrier(n)
    errors: list = []
    results: list = [None] * n

    def target(i):
        try:
            barrier.wait(timeout=60)
            results[i] = work(i)
        except BaseException as exc:  # reported below, with the thread
            errors.append((i, exc))

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    wall = time.perf_counter() - t0
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    assert not errors, f"thread {errors[0][0]} failed: {type(errors[0][1]).__name__}: {errors[0][1]}"
    return results, wall


@pytest.mark.parametrize("name", ["wgpu", "numpy"])
def test_eight_threads_sharing_one_backend_get_the_single_thread_bits(be, name):
    """R19 under threads: forward, forward_partials and (wgpu) resident-cache calls from 8
    threads at once on one shared backend give exactly the bits of one thread, every round."""
    backend = be if name == "wgpu" else psa.get_backend("numpy")
    problems = _thread_problems()
    rounds = 6

    def call(pb, r, resident):
        if r % 3 == 1:
            ix = pb.build_index()
            p = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, ix, backend=backend)
            return psa.combine_partials(p, ix)
        k, v = resident if (resident and r % 3 == 2) else (pb.k_cache, pb.v_cache)
        return psa.forward(pb.q, k, v, *pb.args[3:], **pb.options, backend=backend, return_lse=True)

    want = []  # one thread first: the expected bits of each kind of call, checked against the reference
    for pb in problems:
        resident = backend.upload_kv_cache(pb.k_cache, pb.v_cache) if name == "wgpu" else None
        ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
        bits = []
        for r in range(3):
            out, lse = call(pb, r, resident)
            assert_attention_close(out, ref, dtype=pb.k_cache.dtype, lse=lse, ref_lse=ref_lse)
            bits.append((out.tobytes(), lse.tobytes()))
        want.append(bits)
        for a in resident or ():
            a.release()

    def work(i):
        pb = problems[i]
        resident = backend.upload_kv_cache(pb.k_cache, pb.v_cache) if name == "wgpu" else None
        try:
            for r in range(rounds):
                out, lse = call(pb, r, resident)
                assert (out.tobytes(), lse.tobytes()) == want[i][r % 3], f"thread {i} round {r}: different bits"
        finally:
            for a in resident or ():
                a.release()
        return rounds

    done, wall = _run_threads(work, N_THREADS)
    assert sum(done) == N_THREADS * rounds
    print(f"\n[threads] {name}: {N_THREADS} threads x {rounds} calls, all bit-identical, {wall:.2f} s")


# --- soak ------------------------------------------------------------------------------------------

SOAK_CALLS = 500


def _soak_problem(rng):
    """A random small problem of one model's cache geometry (D = 8, pages of 2), as a server sees:
    batches of any composition, lengths, selections, block sizes and dtypes."""
    return random_problem(int(rng.integers(1 << 30)), seqlens_q=tuple(int(x) for x in rng.integers(0, 4, rng.integers(1, 4))),
                        Hkv=int(rng.integers(1, 3)), G=int(rng.choice([1, 2])), D=8, page_size=2,
                        ppb=int(rng.integers(1, 3)), msb=int(rng.integers(1, 4)), causal=bool(rng.integers(2)),
                        dtype=np.float16 if rng.random() < 0.25 else np.float32, used="random",
                        poison=bool(rng.integers(2)))


def test_soak_500_mixed_calls_keep_memory_buffers_and_pipelines_bounded(be):
    """500 forward() calls of random small problems, alternating numpy and wgpu: every result
    agrees with the other backend, and the live wgpu buffers, the cached pipelines, the Python
    objects and the resident memory stop growing (bounds asserted, numbers printed)."""
    from paged_sparse_attn.backends.wgpu._device import MAX_PIPELINES

    rng = np.random.default_rng(2024)
    np_be = psa.get_backend("numpy")
    start_rss = rss_bytes()
    start_bufs = live_buffers()
    rss, bufs, pipes = [], [], []
    warm = SOAK_CALLS // 5
    objs_warm = None
    t0 = time.perf_counter()
    for i in range(SOAK_CALLS):
        pb = _soak_problem(rng)
        backend, other = (be, np_be) if i % 2 else (np_be, be)
        out, lse = psa.forward(*pb.args, **pb.options, backend=backend, return_lse=True)
        if i % 25 == 0:  # a cross-check now and then: the soak must not trade correctness
            want, want_lse = psa.forward(*pb.args, **pb.options, backend=other, return_lse=True)
            tol = tolerance(pb.k_cache.dtype)  # two float32 results: twice the tolerance of one
            assert_attention_close(out, want, dtype=pb.k_cache.dtype, lse=lse, ref_lse=want_lse,
                                   tol=Tolerance(2 * tol.out, 2 * tol.lse), err_msg=f"call {i}:")
        if i % 2:
            bufs.append(wgpu_object_counts().get("Buffer", 0))
            pipes.append(len(be.device_context.pipelines))
        rss.append(rss_bytes() or 0)
        if i == warm:
            gc.collect()
            objs_warm = len(gc.get_objects())
    wall = time.perf_counter() - t0
    gc.collect()
    objs_end = len(gc.get_objects())
    end_bufs = live_buffers()
    mib = 2.0 ** 20
    print(f"\n[soak] {SOAK_CALLS} calls in {wall:.1f} s; RSS start {start_rss / mib:.1f} MiB, after {warm} calls "
          f"{rss[warm] / mib:.1f} MiB, end {rss[-1] / mib:.1f} MiB, max {max(rss) / mib:.1f} MiB (peak "
          f"{(peak_rss_bytes() or 0) / mib:.1f} MiB); live wgpu buffers start {start_bufs}, max {max(bufs)}, "
          f"end {end_bufs}; pipelines max {max(pipes)}; Python objects after warm-up {objs_warm}, end {objs_end}")
    # buffers: the scratch (2) and the per-call pool (at most 8 roles for these one-batch calls)
    assert max(bufs) <= start_bufs + 2 + 8, f"live wgpu buffers grew to {max(bufs)} (start {start_bufs})"
    assert max(bufs[:len(bufs) // 5]) == max(bufs), "live wgpu buffers were still growing after warm-up"
    assert max(pipes) <= MAX_PIPELINES
    assert objs_end - objs_warm < 2000, f"Python objects grew by {objs_end - objs_warm} after warm-up"
    if rss[0]:
        assert rss[-1] - rss[warm] < 48 * mib, (
            f"resident memory grew by {(rss[-1] - rss[warm]) / mib:.1f} MiB after warm-up")


@pytest.mark.parametrize("bad", ["3-D cache", "float64 cache", "k and v differ", "page id >= P", "page shape"])
def test_R17_uploads_and_page_updates_refuse_bad_input_before_device_work(be, bad):
    pb = random_problem(8, seqlens_q=(2,), D=8, poison=False)
    k, v = pb.k_cache, pb.v_cache
    kd, vd = be.upload_kv_cache(k, v)
    P = k.shape[0]
    calls = {
        "3-D cache": (lambda: be.upload_kv_cache(k[:, 0], v[:, 0]), "R1"),
        "float64 cache": (lambda: be.upload_kv_cache(k.astype(np.float64), v.astype(np.float64)), "R7"),
        "k and v differ": (lambda: be.upload_kv_cache(k, v[:-1]), "R1"),
        "page id >= P": (lambda: be.update_pages(kd, vd, [P], k[:1], v[:1]), "R2"),
        "page shape": (lambda: be.update_pages(kd, vd, [0], k[:1, :, :1], v[:1, :, :1]), "R1"),
    }
    call, rule = calls[bad]
    try:
        with no_device_work(methods=()) as hits, pytest.raises(psa.SpecError) as info:
            call()
        assert not hits, f"{hits[0]} ran before the refusal"
        assert info.value.rule == rule and str(info.value).endswith(f"[{rule}]"), str(info.value)
        assert kd.to_numpy().tobytes() == k.tobytes()  # the resident cache is unchanged
    finally:
        kd.release()
        vd.release()


def test_R18_a_plan_whose_partials_pass_a_binding_by_their_empty_group_is_refused(WgpuBackend):
    """A device plan keeps one partial group more than it has edges (the empty group the decode
    combine points unused slots at): 2 edges of 64 floats take 512 bytes, the buffer 768. With
    bindings of 512 bytes the plan is refused up front, naming the bytes (R18), not left to the
    device's validation of a bind group."""
    small = WgpuBackend(required_limits="default", max_binding_size=512)
    with pytest.raises(UnsupportedError, match=r"its partials take 768 bytes, more than one storage binding \(512"):
        psa.plan_attention(np.array([[0, 1]], np.int32), np.array([0, 1], np.int32), np.array([8], np.int32),
                           block_size=4, page_size=4, num_q_heads=1, num_kv_heads=1, head_dim=64,
                           kv_dtype="float32", topk=2, backend=small)
    small.close()
