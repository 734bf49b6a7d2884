"""The device-resident runtime of a plan (R32) on the wgpu backend: one command encoder per layer, or
several layers per encoder and submission on device arrays (R36, ``_batch.py``).

Made once per batch layout (``make_runtime``): every buffer, bind group and
pipeline a layer needs. A layer then encodes

1. the layer's ``q`` and ``selected``: device arrays bound where they are (bind groups kept per
   buffer; a copy into the plan's buffer for one at an offset), host arrays written into the
   plan's buffers (one ``write_buffer`` each); a float16 ``q`` (host or device) is
   written or bound as it is and widened into the plan's float32 ``q`` by ``psa_widen.wgsl``, the
   first dispatch of the layer's first pass (R7: the same float32 values, half the bytes, no
   widening on the host);
2. pass A, the KV-outer inversion (R13) on the device, one invocation per slot of ``selected``
   (a device array bound where it is): ``psa_invert.wgsl`` ``mark`` (R6 checks, flag bits, row
   and slot-group counts), ``psa_scan.wgsl`` (edge, row and work-item numbers), ``scatter``
   (edges, the combine's row lists, the partials kernel's work items and page lists, and the
   partials dispatch size);
3. the partials kernel's params record copied from pass A's output into its uniform buffer;
4. pass B: the partials kernel (an indirect dispatch sized by pass A, or a fixed grid for a kernel
   whose workgroups loop over items) and the combine (``psa_merge.wgsl``);
5. the results: written into a new device buffer (device ``q``: the results stay there, R30);
   for a host ``q`` into a block of host memory the GPU maps, lent to the caller as ``out``
   (``_host_io.py``: where the device makes such buffers and the plan is small), else copied
   into the plan's readback buffer, mapped once. Host ``q`` and ``selected`` are written with
   one ``queue.write_buffer`` each (measured faster than staging them in pinned memory), but a
   host ``q`` of ``_host_io.INPUT_MIN_BYTES`` or more (prefill), which is copied into the plan's
   pinned memory and from there by the encoder, where the device maps host memory.

A layer whose every per-call tensor is a device array is recorded into the device's open batch
(``_batch.open_batch``) instead of an encoder of its own, and submitted with the layers around
it (every ``layers_per_submission``, or before the next use of the queue); a decode layer with
device results ends its pass with ``psa_handoff.wgsl`` (the R6 error words into its results)
instead of clearing the words before the pass and copying them after it.

No numpy over Tq or E runs per layer; the only allocation is the result buffer of a device call.
The caches must be device-resident (``upload_kv_cache``) and each fit one storage binding; other
calls run the host-planned path (``WgpuBackend.forward``) with host queries and selections, and
device queries or selections are refused (R18) there.
"""

from __future__ import annotations

import contextlib
import math
import time
from types import SimpleNamespace

import numpy as np

from ..._index import build_index_arrays, local_blocks, query_positions, run_starts
from ..._layout import BatchLayout
from ..._types import DeviceArray, KVOuterIndex
from ...errors import SpecError, UnsupportedError
from . import _host_io
from ._batch import drop, flush, open_batch
from ._device import PipelineCache, after_device_error, destroy_all, device_errors
from ._host_io import host_input, host_io
from ._record import new_encoder, recorder
from ._resident import MERGE_WG, merge_constants
from ._tensors import CallResult, error_message, lse_from_ml
from ._transfer import map_read, read_ranges, wait_queue_spinning
from ._webgpu import BufferUsage, QueryType

__all__ = ["DeviceRuntime"]

SCAN = "psa_scan.wgsl"
INVERT = "psa_invert.wgsl"
MERGE = "psa_merge.wgsl"
HANDOFF = "psa_handoff.wgsl"
WIDEN = "psa_widen.wgsl"
WIDEN_WG = 256
_F32 = np.dtype(np.float32)
SCAN_WG = 256
TILE = 4 * SCAN_WG
INV_WG = 64
REC = 256  # bytes between uniform records (min-uniform-buffer-offset-alignment; raised per device)
# uniform records of the consts buffer
R_EDGES, R_SCAN1, R_MERGE = range(3)
SCAN_REC = 48  # bytes of psa_scan.wgsl's ScanParams
# words a slot group's edge count is kept in (psa_invert.wgsl's gsub: a group's queries add to
# different words, which the scan adds up; in one word the adds wait on each other: the bench's
# prefill `mark` took 34-35 us on an H200 that way, 21 with 8 words)
GROUP_WORDS = 8
POOL = 8  # result buffers kept for reuse
# the R6 error words in the args buffer (psa_invert.wgsl's args[12], args[13]: a flag and the
# first bad row; ERR_BYTES read or handed over), with the two words after them (ERR_SPAN cleared)
ERR_AT = 48
ERR_BYTES = 8
ERR_SPAN = 16
# bind groups a plan keeps by the buffers they bind, least recently used evicted: a model's
# layers each bring their own queries (and index queries), so the cache must hold a bind group
# per layer and tensor of a whole model step; too few and every layer makes new ones (32 did,
# for a 32-layer loop with results pooled: 1.5-2 x the host time per layer). A bind group of a
# destroyed buffer holds no memory (destroy frees it); keys are buffer uids, never reused.
PLAN_BIND_GROUPS = 512
# a device-resident layer whose block-score items give every score key exactly one item (decode)
# stores the keys (psa_block_scores_decode_sg.wgsl's ONCE) instead of clearing the scores and
# merging into them
SCORES_ONCE = True


def covers_once(items: np.ndarray, Tq: int, Hkv: int, msb: int) -> bool:
    """Whether block-score work items ``[n, 8]`` (``t0, r0, n_rows, nh, h_off, pages, npos, s``;
    ``_index_branch``'s plan, one chunk) hold every key ``(t, h, s)`` of a ``[Tq, Hkv, msb]`` score
    buffer exactly once: then each key is written by one item and none keeps an old value."""
    n_rows = items[:, 2].astype(np.int64)
    total = int(n_rows.sum())
    if total != Tq * Hkv * msb or total == 0:
        return False
    it = np.repeat(items.astype(np.int64), n_rows, axis=0)
    j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
    r = it[:, 1] + j
    t, h, s = it[:, 0] + r // it[:, 3], it[:, 4] + r % it[:, 3], it[:, 7]
    if (t < 0).any() or (t >= Tq).any() or (h < 0).any() or (h >= Hkv).any() or (s < 0).any() or (s >= msb).any():
        return False
    return int(np.unique((t * Hkv + h) * msb + s).size) == total


def _grid(n: int, maxdim: int) -> tuple[int, int]:
    n = max(1, int(n))
    gx = min(n, maxdim)
    return gx, -(-n // gx)


def _words(*vals) -> np.ndarray:
    out = np.zeros(len(vals), dtype=np.uint32)
    for i, v in enumerate(vals):
        out[i] = np.array([v], np.float32).view(np.uint32)[0] if isinstance(v, float) else int(v)
    return out


class DeviceRuntime:
    """Buffers, bind groups and pipelines of one batch layout on one wgpu device.

    Parameters
    ----------
    backend : WgpuBackend
    layout : BatchLayout
    """

    def __init__(self, backend, layout: BatchLayout):
        self.be = backend
        self.bufs: list = []
        self.pool: list = []  # result buffers of device calls whose results were dropped
        self.layout = layout
        self.sparse = None  # the index branch's buffers, made by the first run_sparse
        self.bg_part = PipelineCache(PLAN_BIND_GROUPS)
        self.bind_groups_made = 0
        with backend._lock:
            try:
                with device_errors("plan_attention (device buffers and pipelines)"):
                    self._build(layout)
            except BaseException as exc:
                self.close()
                self._after_error(exc)
                raise

    def _after_error(self, exc: BaseException) -> None:
        after_device_error(self.be, exc)  # the backend's one device-loss policy

    # --- construction ---------------------------------------------------------------------------

    def _buffer(self, nbytes: int, usage: int, label: str, owner: list | None = None):
        b = self.ctx.device.create_buffer(size=max(16, int(nbytes) + (-int(nbytes)) % 4), usage=usage,
                                          label=f"plan.{label}")
        (self.bufs if owner is None else owner).append(b)
        return b

    def _build(self, L: BatchLayout) -> None:

        be = self.be
        fn = "plan_attention"
        ctx = self.ctx = be._device()
        self.generation = be._generation
        self.rec = recorder(ctx.runtime)  # dispatches through the C functions (_record.py)
        U = BufferUsage
        Tq, Hkv, K, msb, B = L.num_queries, L.num_kv_heads, L.topk, L.msb, L.num_seqs
        G, D, S, BS, ppb = L.group_size, L.head_dim, L.page_size, L.block_size, L.pages_per_block
        itemsize = L.kv_dtype.itemsize
        be._check_cache_dtype(L.kv_dtype, fn)
        R = Tq * Hkv
        emax = R * K
        self.R, self.emax, self.Tq, self.Hq, self.D, self.G = R, emax, Tq, L.num_q_heads, D, G
        self.empty = emax == 0
        if self.empty:
            return
        maxdim = ctx.workgroups_per_dim
        align = max(REC, ctx.uniform_align)
        self.align = align
        # the partials kernel: decode when no sequence has two queries (a block read by one query)
        view = SimpleNamespace(max_slot_edges=max(1, L.max_queries_per_seq),
                               index=SimpleNamespace(page_size=S, block_size=BS))
        geom = be._geometry(ctx, view, D, G, itemsize, fn)
        self.geom = geom
        decode = getattr(geom, "kernel", None) == "psa_partials_decode.wgsl"
        hpi, nh = geom.heads_per_item, geom.head_splits
        epi = 1 if decode else geom.edges_per_item
        # psa_invert.wgsl's work words: a flag bit per (KV head, query, block), a kept mark per
        # slot and a count per slot group (KV head, sequence, block) in gsub words; the scan
        # numbers all three (one element per group)
        n_flags = Hkv * Tq * msb
        nfw = -(-n_flags // 32)
        n_groups = Hkv * B * msb
        gsub = 1 if decode else GROUP_WORDS
        n1 = nfw + emax + n_groups
        nt1 = -(-n1 // TILE)
        s1_dst, s1_tiles = 0, n1
        scan_words = s1_tiles + nt1 + 1
        work_words = nfw + emax + n_groups * gsub
        max_items = emax * nh
        erec_base = max_items * 8
        page_base = erec_base + 2 * emax
        plan_words = page_base + emax * ppb + 64  # (+ a lane's reach past the last page list)
        sizes = {"KV-outer flags (Hkv x Tq x msb bits) and counts": 4 * work_words, "prefix sums": 4 * scan_words,
                 "work items": 4 * plan_words, "partials": (emax + 1) * G * D * 4, "q": Tq * L.num_q_heads * D * 4,
                 "out": Tq * L.num_q_heads * D * 4}
        for what, nb in sizes.items():
            if nb > ctx.binding_size:
                raise UnsupportedError(
                    f"{fn}(): backend 'wgpu' cannot plan this layout on the device: its {what} take {nb} bytes, "
                    f"more than one storage binding ({ctx.binding_size} bytes); plan fewer queries per batch, or "
                    "call forward() with host arrays (batched on the host) [R18]")
        wg_cap = geom.max_workgroups or 0  # (a kernel whose workgroups loop over items: at most so many)
        gx_p = min(max_items, wg_cap or max_items, maxdim)
        # such a kernel runs on a fixed grid of that many (or max_items) workgroups, those past the
        # item count returning at once: a direct dispatch. An indirect one is validated by Dawn
        # with a dispatch of its own and took 125 us of host time per layer on an H200.
        self.part_grid = (min(max_items, wg_cap), 1) if 0 < wg_cap <= maxdim else None
        kname = "decode" if decode else ("sgmat" if geom.kernel_name == "psa_partials_sgmat.wgsl" else "generic")
        self.geometry = {"kernel": kname, "hpi": hpi, "nh": nh, "epi": epi, "gx": gx_p}

        # the layout's data and every buffer, once
        st = U.STORAGE
        self.lay = self._buffer(4 * (2 * Tq + 2 * B + L.block_tables.size), st | U.COPY_DST, "layout")
        self.q = self._buffer(Tq * L.num_q_heads * D * 4, st | U.COPY_DST, "q")
        self.sel = self._buffer(emax * 4, st | U.COPY_DST, "selected")
        self.work = self._buffer(4 * work_words, st | U.COPY_DST, "flags")
        self.work_bytes = int(self.work.size)
        self.scan = self._buffer(4 * scan_words, st, "prefix")
        self.edges = self._buffer(4 * 6 * emax, st | U.COPY_SRC, "edges")
        self.merge = self._buffer(4 * (R + 1 + emax), st | U.COPY_SRC, "rows")
        self.plan = self._buffer(4 * plan_words, st | U.COPY_SRC, "items")
        self.args = self._buffer(64, st | U.INDIRECT | U.COPY_SRC | U.COPY_DST, "args")
        self.pparams = self._buffer(align, U.UNIFORM | U.COPY_DST, "partials.params")
        # one more partial group than edges: group emax stays empty (l = 0; the direct mode's
        # merge elements of a row's unused slots point at it)
        self.po = self._buffer((emax + 1) * G * D * 4, st, "partials.o")
        self.pml = self._buffer((emax + 1) * G * 8, st, "partials.ml")
        rows = Tq * L.num_q_heads
        self.o_bytes, self.ml_bytes = rows * D * 4, rows * 8
        self.out = self._buffer(self.o_bytes, st | U.COPY_SRC, "out")
        self.oml = self._buffer(self.ml_bytes, st | U.COPY_SRC, "out.ml")
        self.rb = self._buffer(self.o_bytes + self.ml_bytes + 8, U.MAP_READ | U.COPY_DST, "readback")
        self.hio = None  # pinned results of host calls (_host_io.py), made by the first
        self.hio_made = False  # (None where the device cannot map host memory)
        self.hin = None  # pinned memory of a large host q (_host_io.InputBlock), made by the first
        self.hin_made = False  # call with one (None where not taken)
        self.consts = self._buffer(3 * align, U.UNIFORM | U.COPY_DST, "consts")

        # uniform records
        edges_grid = _grid(-(-emax // INV_WG), maxdim)
        slab4 = (S * (-(-D // 4) * 4)) // 4
        inv = lambda gx, K=K: _words(Tq, Hkv, K, msb, BS, ppb, L.block_tables.shape[1], n_flags, G, nh, hpi, epi,
                                erec_base, page_base, gx_p, emax, 2 * Tq, 2 * Tq + 2 * B, s1_dst, s1_tiles, nt1,
                                nfw, B, gsub, 0, gx, slab4, float(L.softmax_scale), wg_cap, 0, 0, 0)
        g1 = _grid(nt1, maxdim)
        merge_c = merge_constants(D, rows)
        merge_wgs = -(-rows * (D // merge_c["DV"]) // MERGE_WG)
        mg = _grid(merge_wgs, maxdim)
        recs = {R_EDGES: inv(edges_grid[0]),
                R_SCAN1: _words(n1, nfw, 0, s1_dst, s1_tiles, nt1, g1[0], nfw + emax, epi, gsub, 0, 0),
                R_MERGE: _words(0, rows, mg[0], R + 1, 1, G, 0, 0)}
        consts = np.zeros((len(recs), align // 4), np.uint32)
        for i, r in recs.items():
            consts[i, :r.shape[0]] = r
        dev = ctx.device
        dev.queue.write_buffer(self.consts, 0, consts)
        self._write_layout(L)

        # pipelines and bind groups
        cst = {"WG": INV_WG, "DECODE": int(decode), "TILE": TILE}
        # (attention reads no edge fields: its scatter writes none; the index's is made when read)
        self.p_inv = {e: be._pipeline(INVERT, False, {**cst, "EDGES": int(e != "scatter")}, entry=e)
                      for e in (["mark", "scatter"] + (["direct"] if decode else []))}
        self._inv_consts = cst
        self.p_scan = {e: be._pipeline(SCAN, False, {"WG": SCAN_WG}, entry=e) for e in ("tiles", "totals")}
        f16 = itemsize == 2
        # R34: an NHD cache interleaves the rows of its Hkv heads per page (what CacheLayout.make
        # gives the resident caches this plan reads; they are checked to be in the plan's layout)
        rh = {"RH": Hkv} if L.kv_layout == "NHD" and Hkv > 1 else {}
        self.p_part = be._pipeline(geom.kernel_name, f16, {**geom.constants(), **rh})
        self.p_merge = be._pipeline(MERGE, False, merge_c)

        def ub(i, size):
            return {"buffer": self.consts, "offset": i * align, "size": size}

        def bg(bgl, res):
            return dev.create_bind_group(layout=bgl, entries=[{"binding": j, "resource": r} for j, r in enumerate(res)])

        # the inversion's resources: record i of the consts and the selection in buffer `sel`
        inv_res = lambda i, sel=None: [ub(i, 128)] + [{"buffer": b} for b in (
            self.sel if sel is None else sel, self.lay, self.work, self.scan, self.edges, self.merge, self.plan,
            self.args)]
        bgl_scan = self.p_scan["tiles"][1]
        self.bg_scan1 = bg(bgl_scan, [ub(R_SCAN1, SCAN_REC), {"buffer": self.work}, {"buffer": self.scan}])
        self.bg_merge = bg(self.p_merge[1], [ub(R_MERGE, 32)] + [{"buffer": b} for b in (
            self.po, self.pml, self.merge, self.out, self.oml)])
        self._ub_merge = ub(R_MERGE, 32)
        self.p_hand = None  # psa_handoff.wgsl's pipeline, made by the first device call (_handoff)
        self.p_widen, self.halves = {}, {}  # psa_widen.wgsl's pipelines (by size) and float16 buffers (by role)
        self.bg_part = PipelineCache(PLAN_BIND_GROUPS)
        self._inv_record, self._inv_res, self._bg = inv, inv_res, bg
        self.grids = {"edges": edges_grid, "scan1": g1, "merge": mg}
        self.decode = decode
        if decode:  # the direct mode's fixed parts: the partials' dispatch and params
            self.direct_grid = _grid(max_items, maxdim)
            rec = np.zeros(align // 4, np.uint32)
            rec[:8] = _words(0, max_items, self.direct_grid[0], G, slab4, float(L.softmax_scale), 0, 0)
            self.pparams_direct = self._buffer(align, U.UNIFORM | U.COPY_DST, "partials.params.direct")
            dev.queue.write_buffer(self.pparams_direct, 0, rec)

    def _write_layout(self, L: BatchLayout) -> None:
        seq, hi = query_positions(L.cu_seqlens_q, L.used_kv_lens, L.causal)
        T = np.diff(L.cu_seqlens_q.astype(np.int64))
        lay = np.concatenate([np.stack([seq, hi], 1).reshape(-1),
                              np.stack([L.cu_seqlens_q[:-1].astype(np.int64), T], 1).reshape(-1),
                              L.block_tables.reshape(-1).astype(np.int64)]).astype(np.int32)
        if lay.size:
            self.ctx.device.queue.write_buffer(self.lay, 0, lay)

    def update(self, layout: BatchLayout) -> None:
        with self.be._lock:
            self.layout = layout
            if not self.empty:
                self._live()
                self._write_layout(layout)
                self._drop_sparse()  # its visible blocks and local blocks follow the lengths

    def _result_buffer(self):
        """A buffer for a device call's results: one whose results nobody holds any more, or new."""

        if self.pool:
            return self.pool.pop()
        return self.ctx.device.create_buffer(size=CallResult.nbytes(self.Tq, self.Hq, self.D),
                                             usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC
                                             | BufferUsage.COPY_DST, label="results")

    def _read_results(self, buf, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        """Byte ranges of a device call's result buffer, through the plan's mapped readback buffer
        (``read_ranges``: one submission, one map, each range copied once)."""
        self._live()
        with device_errors("readback of results", bytes=sum(n for _, n in ranges)):
            return read_ranges(self.ctx.device, buf, ranges, self.rb)

    def _recycle(self, buf) -> None:
        """Take back the buffer of results nobody refers to (kept for the next calls, up to 8)."""
        if self.bufs and self.generation == self.be._generation and len(self.pool) < POOL:
            self.pool.append(buf)
        else:
            destroy_all([buf])

    def _drop_sparse(self) -> None:
        if self.sparse is not None:
            destroy_all(self.sparse.bufs)
            self.sparse = None

    def close(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is not None and ctx.batch is not None and getattr(self, "generation", None) == self.be._generation:
            with contextlib.suppress(Exception):  # (reported to the reads of those layers' results)
                flush(ctx)  # layers recorded with this plan's buffers run before they are destroyed
        self._drop_sparse()
        destroy_all(self.pool)
        self.pool = []
        destroy_all(self.bufs)
        self.bufs = []
        self.bg_part = PipelineCache(PLAN_BIND_GROUPS)
        # the pinned blocks go back to the backend's account when collected (a lent one when the
        # last array over it is gone)
        self.hio = self.hin = None

    def _live(self) -> None:
        if self.generation != self.be._generation or (not self.bufs and not self.empty):
            raise UnsupportedError("AttentionPlan: its device was lost or closed, or the plan was closed; make "
                                   "a new plan [R18]")

    # --- a layer --------------------------------------------------------------------------------

    def _host_path(self, fn: str, q, k, v, sel) -> bool:
        """Whether this call takes the host-planned path (caches on the host or of several chunks)."""
        resident = all(isinstance(a, DeviceArray) and getattr(a, "layout", None) is not None for a in (k, v))
        if resident and k.layout.n_chunks == 1 and v.layout.n_chunks == 1:
            return False
        why = ("the caches are host arrays" if not resident else
               "a cache is split into several storage bindings (chunks)")
        if isinstance(q, DeviceArray) or isinstance(sel, DeviceArray):
            raise UnsupportedError(
                f"{fn}(): backend 'wgpu' runs device-resident q / selected only on device-resident caches of "
                f"one storage binding each, and {why}; upload the caches with upload_kv_cache() (a device with "
                "larger bindings, or float16 caches) or pass host arrays [R18]")
        return True

    def run(self, q, k, v, sel):
        fn = "AttentionPlan.run"
        if self._host_path(fn, q, k, v, sel):
            return NotImplemented  # the plan runs it on the plain path
        with self.be._lock:
            try:
                return self._run_locked(fn, q, k, v, sel)
            except BaseException as exc:
                self._after_error(exc)
                raise

    def _stage(self, enc, src, dst, nbytes: int, dtype) -> None:
        """Copy a layer's tensor into a plan buffer: a device copy, or for a host array one write
        (a large host ``q`` through the plan's pinned memory where the device maps host memory:
        ``_host_io.py``; a call with a host ``q`` waits for its submission, so the memory is
        free again at the next call)."""
        if isinstance(src, DeviceArray):
            enc.copy_buffer_to_buffer(src.buffer(), src.offset, dst, 0, nbytes)
        elif nbytes:
            arr = np.ascontiguousarray(src, dtype=dtype)
            if not (dst is self.q and self._through_pinned(enc, arr, dst)):
                self.ctx.device.queue.write_buffer(dst, 0, arr)

    def _through_pinned(self, enc, arr: np.ndarray, dst) -> bool:
        """Copy the host ``q`` (C-contiguous ``arr``: float32, or float16 before it is widened)
        into the plan's pinned memory and record its copy into ``dst``; False (nothing done)
        where it does not go that way (``_host_input``)."""
        blk = self._host_input(arr.nbytes)
        if blk is None:
            return False
        blk.write(arr)
        enc.copy_buffer_to_buffer(blk.buffer, 0, dst, 0, arr.nbytes)
        return True

    def _host_input(self, nbytes: int):
        """The plan's pinned memory for a host ``q`` of ``nbytes`` (float32, or float16 before it
        is widened; ``_host_io.host_input``), made for a float32 ``q`` by the first call with a
        large one; None where it is not taken."""
        if nbytes < _host_io.INPUT_MIN_BYTES:
            return None
        if not self.hin_made:
            self.hin_made = True
            self.hin = host_input(self.ctx, self.Tq * self.Hq * self.D * 4, self.bufs, self.be._pinned)
        return self.hin if self.hin is not None and nbytes <= self.hin.bytes.nbytes else None

    def _host_io(self):
        """The plan's pinned results (``_host_io.py``), made by the first call with host
        results; None where the device cannot map host memory or the plan is too large."""
        if not self.hio_made:
            self.hio_made = True
            self.hio = host_io(self.ctx, CallResult.nbytes(self.Tq, self.Hq, self.D), self.bufs, self.be._pinned)
        return self.hio

    def _encode(self, enc, q, k, v, sel, *, attention: bool = True, groups=None, cp=None, bg_merge=None,
                handoff=None, wide=None) -> None:
        """``wide``: ``_widened``'s dispatch for a float16 ``q`` (its caller makes it, before any
        pass it leaves open), recorded first in the layer's first pass of attention."""
        # device arrays are bound where they are (bind groups kept per buffer), host arrays written
        # into the plan's buffers; the inversion's kernels run one invocation per slot (edges grid)
        bg_slots = groups
        if groups is None:
            sb = self._bound(enc, sel, self.sel, self.emax * 4, np.int32)
            bg_slots = self._cached(("slots", sb.uid),
                                    lambda: self._bg(self.p_inv["mark"][1], self._inv_res(R_EDGES, sb)))
        if attention and self.decode:  # decode: no copies, one pass
            qb = self._q_buffer(enc, q, wide)
            self._encode_direct(enc, qb, k, v, bg_slots, cp, bg_merge, handoff, wide)
            return
        if cp is not None:
            cp.end()  # the inversion clears buffers first: outside a pass
        qb = self._q_buffer(enc, q, wide)
        enc.clear_buffer(self.work, 0, self.work_bytes)
        self._clear_errors(enc)
        cp = enc.begin_compute_pass(timestamp_writes=self._ts(0))
        if wide is not None:
            self._dispatch(cp, *wide)
        self._dispatch(cp, self.p_inv["mark"][0], bg_slots, self.grids["edges"])
        self._dispatch(cp, self.p_scan["tiles"][0], self.bg_scan1, self.grids["scan1"])
        self._dispatch(cp, self.p_scan["totals"][0], self.bg_scan1, (1, 1))
        scatter = self.p_inv["scatter"] if attention else self._index_scatter()
        self._dispatch(cp, scatter[0], bg_slots, self.grids["edges"])
        cp.end()
        if not attention:
            return
        enc.copy_buffer_to_buffer(self.args, 16, self.pparams, 0, 32)
        cp = enc.begin_compute_pass(timestamp_writes=self._ts(1))
        if self.part_grid is not None:
            self._dispatch(cp, self.p_part[0], self._partials_group(qb, k, v, self.pparams), self.part_grid)
        else:
            cp.set_pipeline(self.p_part[0])
            cp.set_bind_group(0, self._partials_group(qb, k, v, self.pparams))
            cp.dispatch_workgroups_indirect(self.args, 0)
        self._dispatch(cp, self.p_merge[0], bg_merge or self.bg_merge, self.grids["merge"])
        cp.end()

    def _index_scatter(self):
        """``scatter`` writing the edge fields too (``EDGES``): the index read back (R33)."""
        hit = self.p_inv.get("scatter.edges")
        if hit is None:
            hit = self.p_inv["scatter.edges"] = self.be._pipeline(INVERT, False, {**self._inv_consts, "EDGES": 1},
                                                                  entry="scatter")
        return hit

    def _widened(self, enc, x, dst, role: str):
        """A float16 tensor of the layer (R7: ``q``, or ``index_q`` with rows of whole 16-byte
        units) for the plan's float32 buffer ``dst``: written (host) or bound (device) as it is,
        and the dispatch ``(pipeline, bind group, grid)`` of ``psa_widen.wgsl`` that widens it
        into ``dst`` (the caller records it first in the layer's first pass). None for a float32
        tensor (or none), which the caller stages as before, and for a host tensor this kernel
        does not take (bfloat16, an odd number of values: numpy widens it). A device tensor of
        another dtype, or at an offset that is not a whole word, is refused (R18)."""
        if x is None or x.dtype == _F32:
            return None  # (the common case: nothing more per layer)
        dt = np.dtype(x.dtype)
        n = math.prod(x.shape)
        device = isinstance(x, DeviceArray)
        if (not device and dt != np.float16) or n == 0:
            return None
        if dt != np.float16 or (device and x.offset and (x.offset % 4 or n % 2)):
            raise UnsupportedError(
                f"AttentionPlan: backend 'wgpu' takes a device-resident {role} as float32, or as float16 (at a "
                f"byte offset 0, or at a multiple of 4 with an even number of values); got {dt.name}, {n} values "
                f"at offset {x.offset} (upload it as float32: widening is exact) [R18]")
        words = -(-n // 2)  # (an odd n's last word holds one half)
        hit = self.p_widen.get(n)
        if hit is None:
            grid = _grid(-(-words // WIDEN_WG), self.ctx.workgroups_per_dim)
            pipe, bgl = self.be._pipeline(WIDEN, False, {"N": n, "WG": WIDEN_WG, "GX": grid[0]})
            hit = self.p_widen[n] = (pipe, bgl, grid)
        if device and x.offset == 0:
            src = x.buffer()  # (device buffers are whole words: an odd n's last word is there)
        else:
            src = self.halves.get(role)
            if src is None:  # (a role's size is the plan's: made once)
                src = self.halves[role] = self._buffer(4 * words, BufferUsage.STORAGE | BufferUsage.COPY_DST,
                                                       f"{role}.float16")
            if device:
                enc.copy_buffer_to_buffer(x.buffer(), x.offset, src, 0, 2 * n)
            elif n % 2:  # writes move whole words: the last half's word padded
                self.ctx.device.queue.write_buffer(src, 0, np.append(x.reshape(-1), np.float16(0)))
            elif not (role == "q" and self._through_pinned(enc, x, src)):  # (a large q: as _stage does)
                self.ctx.device.queue.write_buffer(src, 0, x)  # (C-contiguous: validated)
        pipe, bgl, grid = hit
        bg = self._cached(("widen", src.uid, dst.uid), lambda: self._bg(bgl, [{"buffer": src}, {"buffer": dst}]))
        return pipe, bg, grid

    def _merge_into(self, res):
        """The combine's bind group writing ``out`` and ``(m, l)`` straight into the result buffer
        ``res`` (two ranges of it: no copies after the pass), or None when ``(m, l)`` would not
        start at a storage offset every device accepts (256 bytes)."""
        if self.o_bytes % 256:
            return None
        return self._cached(("merge", res.uid), lambda: self._bg(self.p_merge[1], [self._ub_merge] + [
            {"buffer": b} for b in (self.po, self.pml, self.merge)] + [
            {"buffer": res, "offset": 0, "size": self.o_bytes},
            {"buffer": res, "offset": self.o_bytes, "size": self.ml_bytes}]))

    def _handoff(self, res):
        """The hand-over's bind group (``psa_handoff.wgsl``: the plan's error words into the
        result buffer ``res``, then zeroed), or None where the result buffer does not fit one
        storage binding (the words are then cleared before the pass and copied after it)."""
        if CallResult.nbytes(self.Tq, self.Hq, self.D) > self.ctx.binding_size:
            return None
        if self.p_hand is None:
            self.p_hand = self.be._pipeline(HANDOFF, False, {"DST": (self.o_bytes + self.ml_bytes) // 4})
        return self._cached(("handoff", res.uid), lambda: self._bg(self.p_hand[1], [{"buffer": self.args},
                                                                                    {"buffer": res}]))

    def _q_buffer(self, enc, q, wide):
        """The buffer the partials kernel binds for the layer's queries: the plan's where ``wide``
        (``_widened``'s dispatch) widens a float16 ``q`` into it, else ``_bound``'s (a device
        ``q`` where it is, decode and prefill alike: no copy of the layer's queries)."""
        if wide is not None:
            return self.q
        return self._bound(enc, q, self.q, self.Tq * self.Hq * self.D * 4, np.float32)

    def _bound(self, enc, x, plan_buf, nbytes: int, dtype):
        """The buffer a kernel binds for a layer's tensor: a device array's own (when it starts at
        offset 0), else the plan's buffer with the host array written (or the array copied) in."""
        if x is None:
            return plan_buf
        if isinstance(x, DeviceArray) and x.offset == 0:
            return x.buffer()
        self._stage(enc, x, plan_buf, nbytes, dtype)
        return plan_buf

    def _cached(self, key, make):
        """A bind group kept by the buffers it binds (``PLAN_BIND_GROUPS``, least recently used
        evicted): a bind group costs more to make than a layer to encode."""
        bg = self.bg_part.get(key)
        if bg is None:
            bg = self.bg_part[key] = make()
            self.bind_groups_made += 1  # (a diagnostic: a steady loop makes none)
        return bg

    def _partials_group(self, qb, k, v, params):
        """The partials kernel's bind group for these queries, caches and params."""
        kb, vb = k.buffers()[0], v.buffers()[0]
        return self._cached(("partials", qb.uid, kb.uid, vb.uid, params.uid), lambda: self.ctx.device.create_bind_group(
            layout=self.p_part[1], entries=[{"binding": j, "resource": {"buffer": b, **({"size": 32} if j == 0 else {})}}
                                            for j, b in enumerate((params, qb, kb, vb, self.plan, self.po, self.pml))]))

    def _encode_direct(self, enc, qb, k, v, bg_slots, cp=None, bg_merge=None, handoff=None, wide=None) -> None:
        """Decode attention without the inversion (``psa_invert.wgsl`` ``direct``): three
        dispatches of fixed sizes in one pass (two when timed, to time them apart), and with
        ``handoff`` (the bind group of ``_handoff``) a fourth that hands the R6 error words over
        to the results and zeroes them (else the caller clears them before and copies them after
        the pass). ``cp``: an open untimed pass to continue (the index branch's), else a pass of
        its own. ``wide``: ``_widened``'s dispatch (a float16 q), dispatched first."""
        if cp is None:
            if handoff is None:
                self._clear_errors(enc)
            ts = self._ts(0)
            # an untimed pass through the C functions where the dispatches go there (_record.py)
            cp = self.rec.begin(enc) if self.rec is not None and ts is None else enc.begin_compute_pass(
                timestamp_writes=ts)
        if wide is not None:
            self._dispatch(cp, *wide)
        self._dispatch(cp, self.p_inv["direct"][0], bg_slots, self.grids["edges"])
        if self._ts(0) is not None:
            cp.end()
            cp = enc.begin_compute_pass(timestamp_writes=self._ts(1))
        self._dispatch(cp, self.p_part[0], self._partials_group(qb, k, v, self.pparams_direct), self.direct_grid)
        self._dispatch(cp, self.p_merge[0], bg_merge or self.bg_merge, self.grids["merge"])
        if handoff is not None:
            self._dispatch(cp, self.p_hand[0], handoff, (1, 1))
        cp.end()

    def _clear_errors(self, enc) -> None:
        """Zero the R6 error words before a pass that may set them (``ERR_AT``)."""
        enc.clear_buffer(self.args, ERR_AT, ERR_SPAN)

    def _dispatch(self, cp, pipe, bgroup, grid) -> None:
        if self.rec is not None:
            self.rec.dispatch3(cp, pipe, bgroup, grid[0], grid[1])
            return
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bgroup)
        cp.dispatch_workgroups(grid[0], grid[1], 1)

    # GPU time of the two passes when the backend records timestamps (timestamps=True)
    def _ts(self, i: int):
        qs = getattr(self, "_qset", None)
        if qs is None:
            return None
        return {"query_set": qs, "beginning_of_pass_write_index": 2 * i, "end_of_pass_write_index": 2 * i + 1}

    def _timing_setup(self):

        want = self.be._opts.get("timestamps") and "timestamp-query" in self.ctx.features
        if want and getattr(self, "_qset", None) is None:
            dev = self.ctx.device
            self._qset = dev.create_query_set(type=QueryType.timestamp, count=8)
            self._tsbuf = self._buffer(64, BufferUsage.QUERY_RESOLVE | BufferUsage.COPY_SRC, "ts")
            self._tsrb = self._buffer(64, BufferUsage.MAP_READ | BufferUsage.COPY_DST, "ts.rb")
        return want

    def _timings(self, enc, sparse: bool) -> None:
        if getattr(self, "_qset", None) is not None:
            n = 8 if sparse else 4
            enc.resolve_query_set(self._qset, 0, n, self._tsbuf, 0)
            enc.copy_buffer_to_buffer(self._tsbuf, 0, self._tsrb, 0, 8 * n)

    def _read_timings(self, t: dict, sparse: bool) -> None:
        """GPU seconds of the passes of the last call (``timestamps=True``): ``gpu_scores_s``
        (block scores), ``gpu_topk_s`` (top-k), ``gpu_index_s`` (both, their passes' start to
        end), ``gpu_invert_s`` (the inversion), ``gpu_attention_s`` (partials and combine),
        ``gpu_total_s`` (first pass start to last pass end)."""
        if getattr(self, "_qset", None) is None:
            return
        n = 8 if sparse else 4
        ts = np.frombuffer(map_read(self._tsrb, 8 * n), dtype=np.uint64).astype(np.int64).copy()
        self._tsrb.unmap()
        k = self.ctx.ns_per_tick * 1e-9
        t.update(gpu_invert_s=float(ts[1] - ts[0]) * k, gpu_attention_s=float(ts[3] - ts[2]) * k,
                 gpu_total_s=float(ts[3] - (ts[4] if sparse else ts[0])) * k)  # passes in that order
        if sparse:
            t.update(gpu_index_s=float(ts[7] - ts[4]) * k, gpu_scores_s=float(ts[5] - ts[4]) * k,
                     gpu_topk_s=float(ts[7] - ts[6]) * k)

    def _run_locked(self, fn, q, k, v, sel, sparse=None):

        self._live()
        t0 = time.perf_counter()
        L = self.layout
        dev = self.ctx.device
        timings: dict = {"path": "device"}
        device_out = isinstance(q, DeviceArray)
        if self.empty:
            return self._empty(fn, device_out, L)
        for a in (k, v):
            a.buffers()  # raises now if released or from a lost device
        timed = self._timing_setup()
        # R36: a layer whose every per-call tensor is a device array (nothing to write from the
        # host) and whose results stay on the device joins the device's open batch
        per_call = sel if sparse is None else sparse[1]
        batched = (device_out and not timed and self.be._layers_per_submission > 1
                   and isinstance(per_call, DeviceArray))
        with device_errors(f"{fn} ({self.geometry['kernel']} kernel)", Tq=self.Tq, edges=self.emax):
            # a device call's results: the combine writes them into the result buffer itself, and
            # (decode) psa_handoff.wgsl the error words
            # host results of an attention layer (a whole MSA layer's are read back): through
            # the pinned memory if any
            hio = self._host_io() if not device_out and sparse is None else None
            block = hio.take() if hio is not None else None
            res_buf = self._result_buffer() if device_out else (block.buffer if block is not None else None)
            bg_merge = self._merge_into(res_buf) if res_buf is not None else None
            handoff = self._handoff(res_buf) if res_buf is not None and self.decode and not timed else None
            batch = open_batch(self.ctx) if batched else None
            # (the encoder made, finished and submitted through the runtime's checked C calls)
            enc = batch.encoder if batched else new_encoder(self.rec, dev.raw)
            try:
                if batched:
                    batch.recording = True  # (a queue operation now would be a bug: _batch.flush raises)
                if sparse is None:
                    self._encode(enc, q, k, v, sel, bg_merge=bg_merge, handoff=handoff,
                                 wide=self._widened(enc, q, self.q, "q"))
                else:
                    self._encode_sparse(enc, q, k, v, *sparse, bg_merge=bg_merge, handoff=handoff)
                dst = res_buf if res_buf is not None else self.rb
                if bg_merge is None:
                    enc.copy_buffer_to_buffer(self.out, 0, dst, 0, self.o_bytes)
                    enc.copy_buffer_to_buffer(self.oml, 0, dst, self.o_bytes, self.ml_bytes)
                if handoff is None:
                    enc.copy_buffer_to_buffer(self.args, ERR_AT, dst, self.o_bytes + self.ml_bytes, ERR_BYTES)
                    if self.decode:  # zero for the next call, which may hand them over without a clear
                        self._clear_errors(enc)
                if timed:
                    self._timings(enc, sparse is not None)
            except BaseException as exc:
                if batched:  # the open batch is incomplete: dropped, its calls raise when read
                    drop(self.ctx, exc)
                if block is not None:
                    hio.put(block)
                raise
            if batched:
                batch.recording = False
            t1 = time.perf_counter()
            if not batched:
                dev.queue.submit_encoder(enc, self.rec)
            else:
                batch.layers += 1
                # (an idle device starts at once: its first layer is not held for the next ones)
                if batch.layers >= self.be._layers_per_submission or self.ctx.queue_idle:
                    flush(self.ctx)
            t2 = time.perf_counter()
            if device_out:
                self.be.last_timings = dict(timings, encode_s=t1 - t0, submit_s=t2 - t1, total_s=t2 - t0,
                                            batched=batched)
                res = CallResult(self.be, res_buf, self.Tq, self.Hq, self.D, fn=fn, num_kv_heads=L.num_kv_heads,
                                 msb=L.msb, generation=self.generation, recycle=self._recycle,
                                 reader=self._read_results, batch=batch)
                return res.tensors()
            n = self.o_bytes + self.ml_bytes + 8
            shape = (self.Tq, self.Hq, self.D)
            out = None
            try:
                if block is not None:
                    wait_queue_spinning(self.ctx)  # the kernels wrote the results into host memory
                    raw = block.bytes
                else:
                    raw = np.frombuffer(map_read(self.rb, n), dtype=np.uint8)  # waits for the submission
                t_map = time.perf_counter()
                err = raw[self.o_bytes + self.ml_bytes:n].view(np.uint32)
                if int(err[0]):
                    raise SpecError(error_message(fn, int(err[0]), int(err[1]), L.num_kv_heads, L.msb), "R6")
                lse = lse_from_ml(raw[self.o_bytes:self.o_bytes + self.ml_bytes].view(np.float32).reshape(-1, 2))
                if block is not None:
                    out = hio.out(block, self.o_bytes, shape)  # (lent: no copy)
                else:
                    out = raw[:self.o_bytes].view(np.float32).reshape(shape).copy()
            finally:
                if block is not None and out is None:
                    hio.put(block)  # not lent after all
                if self.rb.map_state != "unmapped":
                    self.rb.unmap()
            t3 = time.perf_counter()
            timings.update(encode_s=t1 - t0, submit_s=t2 - t1, wait_readback_s=t3 - t2, wait_s=t_map - t2,
                           read_s=t3 - t_map, total_s=t3 - t0)
            self._read_timings(timings, sparse is not None)
            self.be.last_timings = timings
            return out, lse.reshape(self.Tq, self.Hq)

    def _empty(self, fn, device_out: bool, L: BatchLayout):
        """No slot to attend (Tq = 0 or topk = 0): out = 0, lse = -inf (R11)."""

        Tq, Hq, D = L.num_queries, L.num_q_heads, L.head_dim
        if not device_out:
            return np.zeros((Tq, Hq, D), np.float32), np.full((Tq, Hq), -np.inf, np.float32)
        buf = self.ctx.device.create_buffer(size=CallResult.nbytes(Tq, Hq, D),
                                            usage=BufferUsage.STORAGE | BufferUsage.COPY_SRC, label="results")
        res = CallResult(self.be, buf, Tq, Hq, D, fn=fn, num_kv_heads=L.num_kv_heads, msb=L.msb,
                         generation=self.generation)  # WebGPU zero-fills: out 0, l 0 (lse -inf), no error
        return res.tensors()

    # --- the index alone (R33) -------------------------------------------------------------------

    def kvouter_index(self, sel) -> KVOuterIndex:
        L = self.layout
        if self.empty:  # nothing to invert
            return build_index_arrays(np.full((L.num_queries, L.num_kv_heads, L.topk), -1, np.int32), L.layout)
        with self.be._lock:
            self._live()
            dev = self.ctx.device
            fn = "AttentionPlan.kvouter_index"
            with device_errors(fn, Tq=self.Tq, edges=self.emax):
                enc = dev.create_command_encoder(label="paged_sparse_attn.kvouter_index")
                self._encode(enc, None, None, None, sel, attention=False)
                dev.queue.submit([enc.finish()])
                edges = np.frombuffer(dev.queue.read_buffer(self.edges, 0, 24 * self.emax), np.int32).reshape(6, -1)
                merge = np.frombuffer(dev.queue.read_buffer(self.merge, 0, 4 * (self.R + 1 + self.emax)), np.int32)
                err = np.frombuffer(dev.queue.read_buffer(self.args, ERR_AT, ERR_BYTES), np.uint32).copy()
                if self.decode:  # zero for a later call that hands them over without a clear
                    dev.queue.write_buffer(self.args, ERR_AT, np.zeros(ERR_SPAN // 4, np.uint32))
        if int(err[0]):
            raise SpecError(error_message(fn, int(err[0]), int(err[1]), L.num_kv_heads, L.msb), "R6")
        E = int(merge[self.R])
        e_t, e_h, e_b, e_s, e_rank, e_len = (np.ascontiguousarray(edges[i, :E]) for i in range(6))
        # slot groups: runs of equal (h, b, s) in edge order (the host index's definition)
        key = (e_h.astype(np.int64) * L.num_seqs + e_b) * L.msb + e_s
        starts = np.flatnonzero(run_starts(key))
        slot_ptr = np.append(starts, E).astype(np.int32)
        return KVOuterIndex(
            edge_query=e_t, edge_head=e_h, edge_seq=e_b, edge_block=e_s, edge_rank=e_rank, edge_len=e_len,
            slot_ptr=slot_ptr, slot_head=e_h[starts], slot_seq=e_b[starts], slot_block=e_s[starts],
            row_ptr=np.ascontiguousarray(merge[:self.R + 1]), row_edges=np.ascontiguousarray(merge[self.R + 1:self.R + 1 + E]),
            layout=L.layout, num_queries=L.num_queries, num_kv_heads=L.num_kv_heads)

    # --- the whole MSA layer (R25) in one submission ----------------------------------------------

    def run_sparse(self, q, k, v, index_q, index_k_cache):
        fn = "AttentionPlan.run_sparse"
        L = self.layout
        ik = index_k_cache
        host = self._host_path(fn, q, k, v, index_q)
        if not host and not (isinstance(ik, DeviceArray) and getattr(ik, "layout", None) is not None
                             and ik.layout.n_chunks == 1):
            if isinstance(q, DeviceArray) or isinstance(index_q, DeviceArray):
                raise UnsupportedError(f"{fn}(): backend 'wgpu' runs a device-resident layer on a device-resident "
                                       "index_k_cache of one storage binding (upload_index_cache()) [R18]")
            host = True
        if host or self.empty:
            return NotImplemented  # the plan runs it on the plain path
        with self.be._lock:
            sp = self._sparse_setup(fn, ik)
            if isinstance(index_q, DeviceArray) and (L.index_dim % 4 or np.dtype(index_q.dtype) not in (
                    np.dtype(np.float32), np.dtype(np.float16))):
                raise UnsupportedError(f"{fn}(): backend 'wgpu' takes a device-resident index_q as float32 or "
                                       f"float16 with index_dim a multiple of 4, got {np.dtype(index_q.dtype).name} "
                                       f"and {L.index_dim} [R18]")
            try:
                return self._run_locked(fn, q, k, v, None, sparse=(sp, index_q, ik))
            except BaseException as exc:
                self._after_error(exc)
                raise

    def _sparse_setup(self, fn: str, ik):
        """The index branch's buffers, made once per index cache layout: page lists, work items,
        scores, local blocks, the top-k's parameters, and the inversion's records for its output."""

        from ..._types import IndexProblem
        from ._index_branch import PARAM_BYTES as SREC
        from ._index_branch import (
            TOPK,
            _record,
            score_dispatches,
            topk_pipeline_args,
            topk_record,
        )
        from ._plan import grid_dispatches

        key = ik.buffers()[0].uid
        if self.sparse is not None and self.sparse.key == key:
            return self.sparse
        self._drop_sparse()
        L, ctx, be = self.layout, self.ctx, self.be
        Tq, Hkv, msb, d = L.num_queries, L.num_kv_heads, L.msb, L.index_dim
        seq, hi = query_positions(L.cu_seqlens_q, L.used_kv_lens, L.causal)
        p = IndexProblem(index_q_input=np.zeros((Tq, Hkv, d), np.float32), index_k_cache=ik, block_tables=L.block_tables,
                         cu_seqlens_q=L.cu_seqlens_q, used_kv_lens=L.used_kv_lens, query_seq=seq.astype(np.int32),
                         query_end=hi.astype(np.int32), block_size=L.block_size,
                         softmax_scale=1.0 / float(np.sqrt(d)), causal=L.causal, kv_layout=L.kv_layout)
        st = be._score_setup(p, fn)
        if st is not None and st.step < Tq:
            raise UnsupportedError(f"{fn}(): backend 'wgpu' needs the block scores of all {Tq} queries in one "
                                   "storage binding for a device-resident layer; plan fewer queries [R18]")
        U = BufferUsage
        dev = ctx.device
        maxdim = ctx.workgroups_per_dim
        align = self.align
        k_out = min(L.topk, msb)
        rows = Tq * Hkv
        DV = -(-d // 4)
        sp = SimpleNamespace(key=key, DV=DV, k_out=k_out, bufs=[])
        sp.iq = self._buffer(rows * DV * 16, U.STORAGE | U.COPY_DST, "index_q", sp.bufs)
        sp.scores = self._buffer(rows * msb * 4, U.STORAGE | U.COPY_DST, "scores", sp.bufs)
        sp.scores_bytes = int(sp.scores.size)
        local = self._buffer(Tq * 4, U.STORAGE | U.COPY_DST, "local_block", sp.bufs)
        dev.queue.write_buffer(local, 0, local_blocks(L.cu_seqlens_q, L.used_kv_lens, L.block_size).astype(np.int32))
        records, calls = [], []
        sp.once = False
        if st is not None:
            items = st.plan(0, Tq)[0]
            # every score key written by exactly one item (decode): stored, and no clear first
            sp.once = bool(SCORES_ONCE and st.kernel is not None and covers_once(items, Tq, Hkv, msb))
            spipe = be._ib_pipeline(st.kernel[0], st.kernel[1], {**st.kernel[2], "ONCE": 1})[0] if sp.once else st.pipe
            pages = self._buffer(st.pt.nbytes, U.STORAGE | U.COPY_DST, "pages", sp.bufs)
            dev.queue.write_buffer(pages, 0, st.pt)
            words = np.concatenate([st.qend.astype(np.int32).view(np.uint32), items.astype(np.uint32).reshape(-1)])
            splan = self._buffer(words.nbytes, U.STORAGE | U.COPY_DST, "score.items", sp.bufs)
            dev.queue.write_buffer(splan, 0, words)
            kbuf = ik.buffers()[0]
            for f2, cnt, gx, gy in score_dispatches(items.shape[0], st.ipw, maxdim):
                records.append(_record(f2, cnt, gx, Tq, Hkv, msb, float(p.softmax_scale), 0, int(st.starts[1])))
                calls.append((spipe, st.bgl, [sp.iq, kbuf, pages, splan, sp.scores], gx, gy))
        sp.n_score_calls = len(calls)
        entry, consts = topk_pipeline_args(ctx, True, msb, rows)
        tpipe, tbgl = be._ib_pipeline(TOPK, False, consts, entry)
        for f2, cnt, gx, gy in grid_dispatches(rows, maxdim):
            records.append(topk_record(f2, cnt, gx, msb, k_out, Hkv))
            calls.append((tpipe, tbgl, [sp.scores, local, self.sel], gx, gy))
        n = len(records)
        consts = np.zeros((n + 1, align // 4), np.uint32)
        for i, r in enumerate(records):
            consts[i, :r.shape[0]] = r
        consts[n, :32] = self._inv_record(self.grids["edges"][0], K=k_out)
        cbuf = self._buffer(consts.nbytes, U.UNIFORM | U.COPY_DST, "score.consts", sp.bufs)
        dev.queue.write_buffer(cbuf, 0, consts)
        sp.uid = cbuf.uid  # this setup's, in the keys of the bind groups made for it (uids are never reused)

        def bind(iq):
            """The index branch's dispatches reading the index queries from buffer ``iq``."""
            out = []
            for i, (pipe, bgl, res, gx, gy) in enumerate(calls):
                res = [iq if b is sp.iq else b for b in res]
                entries = [{"buffer": cbuf, "offset": i * align, "size": SREC}] + [{"buffer": b} for b in res]
                out.append((pipe, self._bg(bgl, entries), (gx, gy)))
            return out

        sp.bind = bind
        sp.calls = bind(sp.iq)
        bgl_inv = self.p_inv["mark"][1]
        sub = lambda i: [{"buffer": cbuf, "offset": i * align, "size": 128}] + self._inv_res(0)[1:]
        sp.groups = self._bg(bgl_inv, sub(n))  # the inversion's bind group reading the top-k's selection
        self.sparse = sp
        return sp

    def _encode_sparse(self, enc, q, k, v, sp, index_q, ik, bg_merge=None, handoff=None) -> None:
        L = self.layout
        calls = sp.calls
        # a float16 index_q whose rows are whole 16-byte units: widened into sp.iq by the index
        # pass's first dispatch (R7); otherwise bound, copied or written as float32
        wide_iq = self._widened(enc, index_q, sp.iq, "index_q") if L.index_dim % 4 == 0 else None
        if wide_iq is None:
            if isinstance(index_q, DeviceArray):
                if index_q.offset == 0:  # bound where it is (bind groups kept per setup and buffer): no copy
                    buf = index_q.buffer()
                    calls = self._cached(("index_q", sp.uid, buf.uid), lambda: sp.bind(buf))
                else:
                    enc.copy_buffer_to_buffer(index_q.buffer(), index_q.offset, sp.iq, 0, index_q.nbytes)
            elif L.index_dim % 4 == 0:  # rows are whole 16-byte units already: written as they are
                self.ctx.device.queue.write_buffer(sp.iq, 0, np.ascontiguousarray(index_q, dtype=np.float32))
            else:  # rows padded to 16-byte units (a copy)
                iq = np.zeros((L.num_queries, L.num_kv_heads, sp.DV * 4), np.float32)
                iq[:, :, :L.index_dim] = index_q
                self.ctx.device.queue.write_buffer(sp.iq, 0, iq)
        if not sp.once:
            enc.clear_buffer(sp.scores, 0, sp.scores_bytes)
        wide = self._widened(enc, q, self.q, "q")  # (its copy, if any, outside the pass below)
        timed = self._ts(2) is not None
        if self.decode and not timed and handoff is None:
            self._clear_errors(enc)  # (the attention's error words: its pass is this one)
        cp = enc.begin_compute_pass(timestamp_writes=self._ts(2))
        if wide_iq is not None:
            self._dispatch(cp, *wide_iq)
        for i, (pipe, bgroup, grid) in enumerate(calls):  # block scores, then the top-k into the selection
            if i == sp.n_score_calls and self._ts(3) is not None:  # timed: the top-k in a pass of its own
                cp.end()
                cp = enc.begin_compute_pass(timestamp_writes=self._ts(3))
            self._dispatch(cp, pipe, bgroup, grid)
        if timed:
            cp.end()
            cp = None
        # untimed decode: the attention's dispatches continue the same pass (dispatches of a pass
        # run in order); otherwise _encode ends it and begins its own after its clears
        self._encode(enc, q, k, v, None, groups=sp.groups, cp=cp, bg_merge=bg_merge, handoff=handoff, wide=wide)
