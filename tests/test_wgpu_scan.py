"""The device inversion's prefix sums (``psa_scan.wgsl``, R13 on the device) against numpy: three
runs of elements counted three ways (a word of flag bits by its set bits, a count as it is, a
slot group's count kept in ``sub`` words as the work items of ``div`` edges it makes), over
several tiles and a 2-D grid of workgroups. The inversion's results are checked whole by the
kit (``test_R33_plan_inversion_equals_build_kvouter_index``); this test pins the scan alone."""

from __future__ import annotations

import numpy as np
import pytest

from paged_sparse_attn.backends.wgpu._layer import (
    SCAN,
    SCAN_REC,
    SCAN_WG,
    TILE,
    _grid,
    _words,
)
from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage


@pytest.mark.psa_backends(exclude=("numpy",))
@pytest.mark.parametrize("sub, div", [(1, 1), (8, 8), (3, 5)])
def test_R13_the_scan_counts_flag_bits_counts_and_items(backend, sub, div):
    rng = np.random.default_rng(sub * 10 + div)
    n_words, n_plain, n_groups = 1500, 2100, 700  # 4300 elements: five tiles, the last one partial
    words = rng.integers(0, 2 ** 32, n_words, dtype=np.uint64).astype(np.uint32)
    words[rng.random(n_words) < 0.3] = 0
    plain = rng.integers(0, 3, n_plain).astype(np.uint32)
    parts = rng.integers(0, 40, (n_groups, sub)).astype(np.uint32)
    src = np.concatenate([words, plain, parts.reshape(-1)])
    values = np.concatenate([[int(w).bit_count() for w in words], plain,
                             -(-parts.astype(np.int64).sum(1) // div)]).astype(np.int64)
    n = values.size
    nt = -(-n // TILE)
    grid = _grid(nt, 2)  # two workgroups a row: the kernel's row stride is tested too
    rec = np.zeros(SCAN_REC // 4, np.uint32)
    rec[:] = _words(n, n_words, 0, 0, n, nt, grid[0], n_words + n_plain, div, sub, 0, 0)
    ctx = backend.device_context
    dev = ctx.device
    U = BufferUsage
    ub = dev.create_buffer_with_data(data=rec, usage=U.UNIFORM)
    sb = dev.create_buffer_with_data(data=src, usage=U.STORAGE)
    db = dev.create_buffer(size=4 * (n + nt + 1 + 16), usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
    dev.queue.write_buffer(db, 0, np.full(n + nt + 1 + 16, 0xdeadbeef, np.uint32))  # nothing stale passes
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    for entry, g in (("tiles", grid), ("totals", (1, 1))):
        pipe, bgl = backend._pipeline(SCAN, False, {"WG": SCAN_WG}, entry=entry)
        bg = dev.create_bind_group(layout=bgl, entries=[{"binding": 0, "resource": {"buffer": ub}},
                                                        {"binding": 1, "resource": {"buffer": sb}},
                                                        {"binding": 2, "resource": {"buffer": db}}])
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(g[0], g[1], 1)
    cp.end()
    dev.queue.submit([enc.finish()])
    got = np.frombuffer(dev.queue.read_buffer(db), np.uint32).astype(np.int64)
    prefix = got[:n] + got[n + np.arange(n) // TILE]
    want = np.cumsum(values) - values
    bad = np.flatnonzero(prefix != want)
    assert bad.size == 0, f"{bad.size} prefixes wrong, first at {bad[0]}: {prefix[bad[0]]} instead of {want[bad[0]]}"
    assert got[n + nt] == values.sum(), "the grand total"
    assert (got[n + nt + 1:] == 0xdeadbeef).all(), "the scan wrote past its tile sums"
    for b in (ub, sb, db):
        b.destroy()
