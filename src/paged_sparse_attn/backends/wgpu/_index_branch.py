"""The index branch on the wgpu backend: block scores (R22) and exp-free top-k (R24) in WGSL.

:class:`IndexBranchMixin` gives :class:`~paged_sparse_attn.backends.wgpu.WgpuBackend` the two
methods the index-branch API calls, ``block_scores(IndexProblem)`` and
``select_topk(TopkProblem)``, plus :meth:`~IndexBranchMixin.upload_index_cache` for a
device-resident index key cache.

Both kernels compute with integer keys, never infinities or NaN (WGSL guarantees neither): block
scores are kept as order-preserving u32 keys of the float32 maxima (0 = nothing visible,
``0xffffffff`` = NaN), decoded to float32 on the device before they are read back
(``psa_score_keys.wgsl``), and the top-k kernel reads the raw float32 bits of the scores and
ranks integer keys. Inputs of ``_host_io.INPUT_MIN_BYTES`` or more go through pinned host memory
where the device maps it (``_Run.data``). Kernel and layout details are in the headers of
``psa_block_scores.wgsl``, ``psa_score_keys.wgsl`` and ``psa_select_topk.wgsl`` and in the
"wgpu kernels" section of the index-branch guide.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..._types import DeviceArray
from ...errors import DeviceError, UnsupportedError
from ._arrays import CacheLayout, WgpuArray, upload_slabs
from ._device import after_device_error, destroy_all, device_errors
from . import _host_io
from ._host_io import PinnedAccount
from ._transfer import CallBuffers, bind_group
from ._kernels import pipeline
from ._plan import grid_dispatches, unique_sorted
from ._webgpu import BufferUsage

__all__ = ["IndexBranchMixin"]

SCORES = "psa_block_scores.wgsl"
SCORES_DECODE = "psa_block_scores_decode.wgsl"  # items of <= 8 rows (one query per sequence)
SCORES_DECODE_WG = 128
SCORES_DECODE_SG = "psa_block_scores_decode_sg.wgsl"  # the same items, key rows read by lane groups
# its workgroup size (at least R and the subgroup size) and whether the next chunk's loads are in
# flight during a chunk (override PF). Measured on the H200 (decode layer, 8192 items of 4 rows,
# 268 MB of float16 index keys; scripts/experiment_decode.py): WG 64 without prefetch 114.9 us
# (wgpu) / 122.3 (dawn), WG 128 123.9 / 129.5, WG 256 147.2 / 150.7, WG 64 with prefetch
# 122.3 / 127.8, WG 32 with prefetch 119.4 / 124.5; one key row per invocation 189.6 / 190.6.
# Several consecutive items (blocks) per workgroup, loading the queries once for them, was slower
# (2, 4, 8 items: 123.6, 145.4, 143.2 against 120.0 us in one run) and was not kept.
SCORES_DECODE_SG_WG = 64
SCORES_DECODE_SG_PF = 0
# 16-lane groups of at most 4 rows reduce a chunk's 4 x 4 logits together (the kernel's JR)
SCORES_DECODE_SG_JR = True
TOPK = "psa_select_topk.wgsl"
# block_scores() decodes its keys to float32 on the device, the pass's last dispatches (numpy took
# ~18 ms per call for the 4.2 M keys of the bench's prefill on the H200's host)
KEY_DECODE = "psa_score_keys.wgsl"
KEY_DECODE_WG = 256
SCORES_WG = 64  # rows per block-score work item at most (override RT of the shader)
TOPK_WG = 64
# vec4s of a row staged per step (DCV), in order of preference. Measured on the H200 (decode
# layer, 8192 items of 4 rows): with 8-row items DCV = 2 took 500 us and DCV = 8 2450 us (the
# keys of a step are loaded by 32 invocations, latency-bound; smaller tiles keep more workgroups
# resident); 64-row items (prefill) keep DCV = 8.
SCORES_STAGE = {64: (8, 4, 2, 1)}
SCORES_STAGE_SMALL = (2, 1)


def decode_sg_constants(*, DV: int, itemsize: int, rows: int, subgroup: tuple, wg_limit: int,
                        enabled: bool = True) -> tuple[dict | None, str]:
    """Override constants of psa_block_scores_decode_sg.wgsl for items of at most ``rows`` (<= 8)
    rows of index queries of ``DV`` vec4s over index keys of ``itemsize`` bytes, or ``(None, why)``
    when it does not apply (psa_block_scores_decode.wgsl runs instead).

    A key row must be whole 16-byte units (TE of them), read by a key group of R lanes: a power
    of two >= TE and >= 8, at most the device's measured subgroup size.
    """
    if not enabled:
        return None, "turned off"
    size, why = subgroup
    if size is None:
        return None, why
    row_bytes = DV * 4 * itemsize
    if row_bytes % 16:
        return None, f"an index key row of {row_bytes} bytes is not whole 16-byte units"
    te = row_bytes // 16
    lanes = max(8, 1 << max(0, te - 1).bit_length())
    if lanes > size:
        return None, f"an index key row is {te} 16-byte units, read by {lanes} lanes; the subgroup size is {size}"
    wg = max(lanes, int(size), min(SCORES_DECODE_SG_WG, wg_limit))
    if wg > wg_limit:
        return None, f"the device allows {wg_limit} invocations per workgroup"
    nr = 4 if rows <= 4 else 8
    return {"DV": DV, "EU": 16 // itemsize, "R": lanes, "SG": int(size), "WG": wg,
            "NR": nr, "PF": SCORES_DECODE_SG_PF, "JR": int(SCORES_DECODE_SG_JR and lanes == 16 and nr == 4)}, ""


# The tensor-core variant (16x16x16 f16 subgroup matrices; docs/spec/numerics.md, "Block scores
# on tensor cores"): float16 HND index keys, d_idx a multiple of 16 in 16..128, pages and blocks
# of whole 16-position tiles (the kernel stages a tile's keys from one page), items of 16 .. 256
# rows.
SCORES_SGMAT = "psa_block_scores_sgmat.wgsl"
SGMAT_SCORES_DIMS = (16, 128)
SGMAT_SCORES_SUBGROUP = 32  # the kernel is 4 to 16 subgroups of exactly this many invocations
# Geometry and whether "auto" takes the tensor-core kernel, measured on the H200 (prefill shape,
# Dawn, GPU timestamps, scripts/experiment_sgmat_scores.py, every variant right): 16-position tiles
# per step x items per workgroup, NT=1 IPW=16 5.43 ms, NT=1 IPW=1 6.50, NT=4 IPW=8 9.33, NT=2
# IPW=16 9.64, NT=2 IPW=8 10.74, NT=1 IPW=8 12.12, NT=2 IPW=1 15.77; the FMA kernel 8.24 ms. With
# the keys as the left operand (S^T, 2026-12-02; scripts/experiment_index_prefill.py --ipw --nt):
# NT=1 IPW=16 3.10 ms, IPW=8 3.11, IPW=32 3.28, NT=2 4.91.
SGMAT_SCORES_NT = 2   # 16-position tiles per step of the kernel (1, 2 or 4)
# consecutive work items per workgroup (the queries are staged once for them). With items of 256
# rows (below; prefill shape, H200, Dawn): IPW = 16 1.55 ms, 24 1.43, 32 1.51, 48 1.68: the spread
# follows how evenly the workgroups (about 650 at IPW = 24) fill the GPU, so other shapes may
# prefer other values; 16 was the best with items of 64 rows and keys from storage
SGMAT_SCORES_IPW = 24
# rows per work item at most (RT, 16 per subgroup; fewer where the device's workgroups cannot hold
# them). Measured on the H200 (Dawn, prefill shape, keys staged once per workgroup, 2026-12-02):
# 64 rows 2.58 ms, 128 rows 2.35 (2.20 with NT = 2), 256 rows 1.88 (1.79 with NT = 2, once the
# query tile and the staged keys shared one array; 1.65 with a leaner fold, 1.55 with four query
# tiles loaded at once; all with IPW = 16)
SGMAT_SCORES_ROWS = 256
SGMAT_SCORES_AUTO = True


def sgmat_scores_workgroup_bytes(nt: int = SGMAT_SCORES_NT, nsg: int = 4) -> int:
    """Workgroup memory of psa_block_scores_sgmat.wgsl (each variable a whole number of 16-byte
    units, as Dawn counts it): one array for the staged query tile (hi and lo, 16 rows of 136
    halves) or the staged keys of a step (16 NT rows of 136 halves), a result buffer of 16 x
    (16 NT + 4) floats per subgroup (``nsg`` subgroups), and a record of 8 bytes per row (16
    per subgroup)."""
    return 2 * max(2 * 16 * 136, 16 * int(nt) * 136) + nsg * 4 * 16 * (16 * int(nt) + 4) + 8 * 16 * nsg


def sgmat_scores_constants(ctx, *, f16: bool, d_idx: int, rows_per_seq: int, hnd: bool,
                           batch_invariant: bool, page_size: int = 64, block_size: int = 128,
                           choice: str = "auto"):
    """``(override constants, "")`` of psa_block_scores_sgmat.wgsl for these block scores, or
    ``(None, why)`` when the FMA kernel runs. ``choice`` "fma" never takes it, "sgmat" raises
    :class:`UnsupportedError` instead of returning None (to compare the kernels). The constants
    hold ``RT`` (rows per work item), ``NT`` and ``IPW`` (work items per workgroup: the host
    dispatches ``ceil(n_items / IPW)`` workgroups, :func:`score_dispatches`)."""
    why = ""
    if choice == "fma":
        return None, "the FMA kernel was asked for"
    if (16, 16, 16) not in getattr(ctx, "sgmat", frozenset()):
        why = "the device has no f16 16x16x16 subgroup matrices"
    elif not f16:
        why = "the index keys are not float16"
    elif not hnd:
        why = "the index keys are not HND slabs"
    elif batch_invariant:
        why = "batch_invariant=True keeps one kernel for every batch"
    elif rows_per_seq <= 8:
        why = "decode items (<= 8 rows) keep their kernel"
    elif not SGMAT_SCORES_DIMS[0] <= d_idx <= SGMAT_SCORES_DIMS[1] or d_idx % 16:
        why = f"d_idx is not a multiple of 16 in {SGMAT_SCORES_DIMS[0]}..{SGMAT_SCORES_DIMS[1]}"
    elif page_size % 16 or block_size % 16:
        why = f"page size {page_size} or block size {block_size} is not a multiple of 16 positions"
    elif getattr(ctx, "subgroup", (None,))[0] != SGMAT_SCORES_SUBGROUP:
        why = f"the subgroup size is not {SGMAT_SCORES_SUBGROUP}"
    else:
        rt = score_rows_per_item(rows_per_seq, cap=SGMAT_SCORES_ROWS, least=16)
        nsg = max(4, rt // 16)  # (subgroups without rows idle: items of fewer than 64 rows)
        need = sgmat_scores_workgroup_bytes(SGMAT_SCORES_NT, nsg)
        while nsg > 4 and (32 * nsg > getattr(ctx, "max_invocations", 256) or need > ctx.workgroup_storage):
            nsg, rt = nsg // 2, rt // 2  # the largest items the device holds
            need = sgmat_scores_workgroup_bytes(SGMAT_SCORES_NT, nsg)
        if need > ctx.workgroup_storage:
            why = f"{need} bytes of workgroup memory needed"
        elif choice == "auto" and not SGMAT_SCORES_AUTO:
            return None, ("the tensor-core kernel is turned off for 'auto' (SGMAT_SCORES_AUTO); ask for it "
                          "with the 'sgmat' choice")
        else:
            return {"RT": rt, "NT": SGMAT_SCORES_NT, "IPW": SGMAT_SCORES_IPW, "NSG": nsg}, ""
    if choice == "sgmat":
        raise UnsupportedError(f"block_scores(): the tensor-core kernel cannot run: {why} [R18]")
    return None, why


def score_dispatches(n_items: int, ipw: int, max_per_dim: int):
    """Dispatches of ``n_items`` block-score work items, ``ipw`` per workgroup: yields
    ``(item_base, n_items, grid_x, grid_y)`` (the params' first item, its item count, the grid)."""
    for f2, cnt, gx, gy in grid_dispatches(-(-int(n_items) // int(ipw)), max_per_dim):
        yield f2 * ipw, min(cnt * ipw, n_items - f2 * ipw), gx, gy


def score_workgroup_bytes(dcv: int, rt: int = 64) -> int:
    """Workgroup memory of psa_block_scores.wgsl: staged queries (RT rows) and keys (128
    positions) of DCV vec4s, the position flags and the row maxima."""
    return dcv * 4 * (rt + 128) * 4 + 128 * 4 + rt * 4


def score_rows_per_item(rows_per_seq: int, cap: int = SCORES_WG, least: int = 8) -> int:
    """RT: ``cap`` rows per block-score work item (64 for the FMA kernel), or the next power of two
    >= the rows of the longest sequence (at least ``least``: 8, one subgroup of 32 invocations of
    the FMA kernel); decode items have Hkv rows."""
    return int(min(cap, max(least, 1 << max(0, int(rows_per_seq) - 1).bit_length())))
TOPK_CAP = 1024  # chosen candidates ranked in workgroup memory (override CAP)
# rows of at most this many block scores are ranked by counting (entry point rank_rows; 0 = never):
# one pass and a few barriers instead of the radix passes (see psa_select_topk.wgsl)
TOPK_RANK_MAX = 4 * TOPK_WG  # (the kernel holds 4 ids per lane)
TOPK_BOUND_MIN_ROWS = 1024   # rows from which the top-k ranks short rows within a bounded list


def topk_cap(ctx) -> int:
    """Chosen candidates a device ranks in workgroup memory (override CAP: 8 bytes each, 2 KiB
    kept for the histograms)."""
    return min(TOPK_CAP, (ctx.workgroup_storage - 2048) // 8)


def topk_pipeline_args(ctx, keys: bool, msb: int, rows: int) -> tuple[str, dict[str, int]]:
    """``(entry point, override constants)`` of ``psa_select_topk.wgsl`` for a dispatch of
    ``rows`` rows of ``msb`` scores on a device (``keys``: block-score keys in). Rows of at most
    ``RANK_MAX = min(TOPK_RANK_MAX, topk_cap(ctx), 4 WG)`` scores are ranked by counting, entry
    point ``rank_rows`` with ``CAP = RANK_MAX``: a workgroup memory of 2.6 KiB instead of 9.4
    KiB, so more workgroups per multiprocessor (the prefill shape's top-k on an H200: 277 -> 89
    us); longer rows take the radix select, ``main``. ``BOUND`` (rank within the list of
    candidates above a bound) only from ``TOPK_BOUND_MIN_ROWS`` rows on (the kernel's header
    has the measurements); the result is the same either way."""
    cap = topk_cap(ctx)
    rank_max = min(TOPK_RANK_MAX, cap, 4 * TOPK_WG)
    extra = {**({"KEYS": 1} if keys else {}), "BOUND": int(int(rows) >= TOPK_BOUND_MIN_ROWS)}
    if 0 < int(msb) <= rank_max:
        return "rank_rows", {"WG": TOPK_WG, "CAP": rank_max, **extra}
    return "main", {"WG": TOPK_WG, "CAP": cap, **extra}


def topk_record(first: int, count: int, grid_x: int, msb: int, k_out: int, heads: int) -> np.ndarray:
    """The Params record of one top-k dispatch (with its id radix passes for ``msb`` blocks)."""
    return _record(first, count, grid_x, msb, k_out, heads, -(-int(msb - 1).bit_length() // 8))
PARAM_BYTES = 48  # one uniform record per dispatch (multiple of 16)
INVALID = 0xFFFFFFFF


def key_decode_dispatches(n_words: int, max_per_dim: int):
    """Dispatches of psa_score_keys.wgsl over ``n_words`` keys: yields ``(params record, grid_x,
    grid_y)``, one invocation per word."""
    for first, count, gx, gy in grid_dispatches(-(-int(n_words) // KEY_DECODE_WG), max_per_dim):
        yield _record(first, count, gx, n_words), gx, gy


def _record(*vals) -> np.ndarray:
    rec = np.zeros(PARAM_BYTES // 4, dtype=np.uint32)
    for i, v in enumerate(vals):
        rec[i] = np.array([v], dtype=np.float32).view(np.uint32)[0] if isinstance(v, float) else int(v)
    return rec


class _Run:
    """Buffers, passes and readbacks of one index-branch submission, on the backend's call helpers
    (``_transfer``, as ``forward()``'s calls): buffers from the device's pool (made for the call
    and freed under a device-memory budget), bind groups cached where every buffer outlives the
    call, and every result read back through one mapped buffer.

    Parameters
    ----------
    ctx : DeviceContext
    pooled : bool
        Take buffers from the pool (False under ``max_device_bytes``: made and freed per call).
    cache_bind_groups : bool
        Every buffer bound outlives the call (pooled buffers, a resident index cache).
    """

    def __init__(self, ctx, pooled: bool, cache_bind_groups: bool = False, pinned: PinnedAccount | None = None):
        self.ctx = ctx
        self.dev = ctx.device
        self.bufs = CallBuffers(ctx, pooled)
        self.cache_bg = cache_bind_groups and pooled
        # large inputs through pinned host memory (pooled calls only: a call under max_device_bytes
        # keeps nothing)
        self.pinned = pinned if pooled else None
        self.owned: list = []  # made outside the pool for this call (an index cache uploaded per call)
        self.slots: dict = {}  # label -> next pool slot: several buffers of one label in a call
        self.clears: list = []  # (buffer, bytes) zeroed before the pass (pooled buffers hold old results)
        self.copies: list = []  # (pinned buffer, buffer, bytes) copied before the pass
        self.records: list = []
        self.calls: list = []  # (pipeline, bind group layout, resources after params, gx, gy)
        self.reads: list = []  # (buffer, nbytes, callback)

    def _slot(self, label: str) -> int:
        n = self.slots.get(label, 0)
        self.slots[label] = n + 1
        return n

    def data(self, arr: np.ndarray, label: str):
        """A storage buffer holding ``arr``: written with ``write_buffer``, or, for an input of
        ``INPUT_MIN_BYTES`` or more on a device that maps host memory, copied by numpy (threads)
        into the device's pinned memory for it (``_host_io.call_input``) and from there by the
        submission. Dawn's ``write_buffer`` of the 16 MiB of a prefill's scores took ~5 ms on the
        H200's host (64 MiB: 21 ms, against 10 for one numpy copy: ``_host_io``)."""
        name, slot = f"index_branch.{label}", self._slot(label)
        if self.pinned is not None and arr.nbytes >= _host_io.INPUT_MIN_BYTES and arr.nbytes % 4 == 0:
            blk = _host_io.call_input(self.ctx, (name, slot), arr.nbytes, self.pinned)
            if blk is not None:
                arr = np.ascontiguousarray(arr)
                dst = self.bufs.get(arr.nbytes, BufferUsage.STORAGE | BufferUsage.COPY_DST, name, slot)
                blk.write(arr)
                self.copies.append((blk.buffer, dst, arr.nbytes))
                return dst
        return self.bufs.upload(arr, BufferUsage.STORAGE, name, slot)

    def output(self, nbytes: int, label: str):
        """A storage buffer of ``nbytes`` zeroed at the start of the submission, read back at the end."""
        need = max(16, nbytes + (-nbytes) % 4)
        b = self.bufs.get(need, BufferUsage.STORAGE | BufferUsage.COPY_SRC | BufferUsage.COPY_DST,
                          f"index_branch.{label}", self._slot(label))
        self.clears.append((b, need))
        return b

    def dispatch(self, pipe, bgl, resources: list, record: np.ndarray, gx: int, gy: int) -> None:
        self.records.append(record)
        self.calls.append((pipe, bgl, resources, gx, gy))

    def read(self, buf, nbytes: int, sink) -> None:
        """Read ``nbytes`` of ``buf`` back after the submission: ``sink`` gets them as a uint8 view
        of the mapped memory, valid during the call only (it must copy what it keeps)."""
        self.reads.append((buf, nbytes, sink))

    def submit(self) -> None:

        dev, align = self.dev, self.ctx.uniform_align
        enc = dev.create_command_encoder(label="paged_sparse_attn.index_branch")
        for b, n in self.clears:
            enc.clear_buffer(b, 0, n)
        for src, dst, n in self.copies:
            enc.copy_buffer_to_buffer(src, 0, dst, 0, n)
        if self.calls:
            params = np.zeros((len(self.records), align // 4), dtype=np.uint32)
            for i, r in enumerate(self.records):
                params[i, :r.shape[0]] = r
            pbuf = self.bufs.upload(params, BufferUsage.UNIFORM, "index_branch.params")
            cp = enc.begin_compute_pass()
            for i, (pipe, bgl, res, gx, gy) in enumerate(self.calls):
                resources = [{"buffer": pbuf, "offset": i * align, "size": PARAM_BYTES}]
                resources += [{"buffer": b} for b in res]
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bind_group(self.ctx, bgl, resources, self.cache_bg))
                cp.dispatch_workgroups(gx, gy, 1)
            cp.end()
        reads = [(buf, n, sink) for buf, n, sink in self.reads if n]
        total = sum(n + (-n) % 4 for _, n, _ in reads)
        rb = None
        if reads:
            rb = self.bufs.get(total, BufferUsage.MAP_READ | BufferUsage.COPY_DST, "index_branch.readback")
            off = 0
            for buf, n, _ in reads:
                enc.copy_buffer_to_buffer(buf, 0, rb, off, n + (-n) % 4)
                off += n + (-n) % 4
        dev.queue.submit([enc.finish()])
        if rb is not None:
            raw = np.frombuffer(self.bufs.map_read(rb, total), dtype=np.uint8)
            off = 0
            for _, n, sink in reads:
                sink(raw[off:off + n])
                off += n + (-n) % 4

    def close(self) -> None:
        self.bufs.close()
        destroy_all(self.owned)
        self.owned = []


class IndexBranchMixin:
    """Index-branch methods of the wgpu backend (needs the backend's device, lock and helpers)."""

    # --- public --------------------------------------------------------------------------------

    def upload_index_cache(self, index_k_cache, *, kv_layout="HND") -> WgpuArray:
        """Copy a paged index key cache ``[P, Hk_idx, S, d_idx]`` to the device, to reuse across calls.

        With ``kv_layout="NHD"`` the array is ``[P, S, Hk_idx, d_idx]`` (R34), held as it is.

        Returns
        -------
        WgpuArray
            Pass it to :func:`~paged_sparse_attn.index_branch.block_scores` or
            :func:`~paged_sparse_attn.index_branch.sparse_attention` in place of the numpy array;
            update pages with ``.write_pages``; free with ``.release()``.
        """
        from ..._validation import cache_dims, check_float_array, check_kv_layout

        fn = "upload_index_cache"
        kvl = check_kv_layout(kv_layout, fn)
        ik = check_float_array(index_k_cache, fn, "index_k_cache", 4)
        self._check_cache_dtype(ik.dtype, fn)
        with self._lock:
            ctx = self._device()
            layout = CacheLayout.make(cache_dims(ik.shape, kvl), ik.dtype, ctx.binding_size, kv_layout=kvl)
            self._check_budget(fn, {"index_k_cache": layout.device_bytes})  # max_device_bytes
            arr = WgpuArray(self, layout, upload_slabs(ctx.device, ik, layout, "index_k_cache"),
                            self._generation, "index_k_cache")
            self._resident.add(arr)
            return arr

    def block_scores(self, problem) -> np.ndarray:
        """Block scores of R22 on the device; float32 ``[Tq, Hkv, msb]`` (see ``psa_block_scores.wgsl``)."""
        return self._ib_guarded(self._block_scores_locked, problem)

    def select_topk(self, problem) -> np.ndarray:
        """Exp-free top-k of R24 on the device; int32 ``[Tq, Hkv, topk]`` (see ``psa_select_topk.wgsl``)."""
        return self._ib_guarded(self._select_topk_locked, problem)

    # --- plumbing --------------------------------------------------------------------------------

    def _ib_guarded(self, fn, problem):
        with self._lock:
            try:
                return fn(problem)
            except DeviceError as exc:
                after_device_error(self, exc)
                raise

    def _ib_pipeline(self, kernel: str, f16: bool, constants: dict, entry: str = "main"):
        """(pipeline, bind group layout) of an index-branch kernel of the kernel table; the
        table's trusted kernels without runtime checks unless ``runtime_checks=True``."""
        return pipeline(self._device(), kernel, constants, entry=entry, f16=f16, checks=self._runtime_checks)

    # --- block scores ----------------------------------------------------------------------------

    def _block_scores_locked(self, p) -> np.ndarray:
        fn = "block_scores"
        setup = self._score_setup(p, fn)
        if setup is None:
            return np.full((p.num_queries, p.num_kv_heads, p.msb), -np.inf, dtype=np.float32)
        return self._block_scores_run(p, setup)

    def _score_setup(self, p, fn: str):
        """Everything of a block-scores call but its index queries: page lists, the pipeline, the
        per-batch query step and the work-item builder (None when nothing is visible)."""
        Tq, Hkv, d = p.index_q.shape
        msb, BS, S, ppb, Hk, B = p.msb, p.block_size, p.page_size, p.pages_per_block, p.num_index_heads, p.num_seqs
        ik = p.index_k_cache
        resident = isinstance(ik, DeviceArray)
        if resident:
            self._own(ik, fn)
        self._check_cache_dtype(np.dtype(ik.dtype), fn)
        if Tq == 0 or p.num_pages == 0:
            return None  # no page exists: every block_tables entry is -1, nothing is visible
        ctx = self._device()
        DV = -(-d // 4)
        cu = p.cu_seqlens_q.astype(np.int64)
        lens = p.used_kv_lens.astype(np.int64)
        qend = p.query_end.astype(np.int64)
        T = np.diff(cu)
        nblk = np.minimum(msb, -(-lens // BS))
        bt = p.block_tables[:, :msb * ppb].astype(np.int64)
        # readable pages (R10): mapped, starting below L_b, of a sequence with queries
        col = np.arange(msb * ppb, dtype=np.int64)
        readable = (bt >= 0) & (col[None, :] * S < lens[:, None]) & (T > 0)[:, None]
        if not readable.any():
            return None
        rb, rc = np.nonzero(readable)
        gslab = (bt[rb, rc][:, None] * Hk + np.arange(Hk)[None, :])  # [n, Hk] global slabs
        if resident:
            layout = ik.layout
            dslab = gslab
        else:
            needed = unique_sorted(gslab.reshape(-1))
            layout = CacheLayout.make((p.num_pages, Hk, S, d), ik.dtype, ctx.binding_size, slab_ids=needed,
                                      kv_layout=p.kv_layout)
            dslab = np.searchsorted(needed, gslab)
        starts = layout.chunk_starts
        nch = layout.n_chunks
        chunk = np.searchsorted(starts, dslab, side="right") - 1
        # page lists [B, msb, Hk, ppb]: device slab or INVALID; chunk of every readable entry
        pt = np.full((B, msb, Hk, ppb), INVALID, dtype=np.uint32)
        pch = np.full((B, msb, Hk, ppb), -1, dtype=np.int64)
        hks = np.broadcast_to(np.arange(Hk), gslab.shape)
        at = (rb[:, None], (rc // ppb)[:, None], hks, (rc % ppb)[:, None])
        pt[at] = dslab.astype(np.uint32)
        pch[at] = chunk
        if pt.nbytes > ctx.binding_size:
            raise UnsupportedError(
                f"{fn}(): backend 'wgpu' cannot hold the page lists of this problem ({pt.nbytes} bytes for "
                f"B={B} x msb={msb} x Hk_idx={Hk} x {ppb} pages) in one storage binding of "
                f"{ctx.binding_size} bytes; split the call into fewer sequences [R18]")

        rows_per_seq = int(T.max(initial=1)) * (Hkv if Hk == 1 else 1)
        ipw = 1  # work items per workgroup
        kernel = None  # (kernel, f16, constants) of the decode key-group pipeline, when it is the one
        f16 = np.dtype(ik.dtype).itemsize == 2
        DCV = 0
        if self._batch_invariant:  # R27: one kernel and one tile whatever the batch
            rows_per_seq = SCORES_WG
        sg, _ = decode_sg_constants(DV=DV, itemsize=np.dtype(ik.dtype).itemsize, rows=rows_per_seq,
                                    subgroup=ctx.subgroup, wg_limit=ctx.max_invocations,
                                    enabled=self._decode_scores_sg)
        if rows_per_seq <= 8 and sg is not None:
            # decode, key rows read by groups of lanes of one subgroup (coalesced whole rows)
            RT = 8
            kernel = (SCORES_DECODE_SG, False, {**sg, "S": S, "BS": BS, **layout.kernel_constants()})
            pipe, bgl = self._ib_pipeline(*kernel)
        elif rows_per_seq <= 8 and 8 * DV * 16 + 32 <= ctx.workgroup_storage:
            # decode: items of at most 8 rows read their keys one row per invocation (measured on
            # the H200: 501 us with the tiled kernel's best stage for the decode layer's 8192 items)
            RT = 8
            pipe, bgl = self._ib_pipeline(SCORES_DECODE, f16, {"DV": DV, "S": S, "BS": BS, "WG": SCORES_DECODE_WG,
                                                                  "NR": 4 if rows_per_seq <= 4 else 8,
                                                                  **layout.kernel_constants()})
        elif (tc := sgmat_scores_constants(ctx, f16=f16, d_idx=d, rows_per_seq=rows_per_seq,
                                           hnd=layout.rh == 1 and layout.kv_layout == "HND",
                                           batch_invariant=self._batch_invariant, page_size=S, block_size=BS,
                                           choice=self._scores_kernel))[0] is not None:
            # tensor cores: the FMA kernel's items (of RT rows), bindings, params and output; IPW
            # items per workgroup
            RT, ipw = tc[0]["RT"], tc[0]["IPW"]
            pipe, bgl = self._ib_pipeline(SCORES_SGMAT, False, {"DV": DV, "S": S, "BS": BS, **tc[0]})
        else:
            RT = score_rows_per_item(rows_per_seq)
            fits = [c for c in SCORES_STAGE.get(RT, SCORES_STAGE_SMALL)
                    if score_workgroup_bytes(c, RT) <= ctx.workgroup_storage]
            if not fits:
                raise UnsupportedError(f"{fn}(): backend 'wgpu' needs {score_workgroup_bytes(1, RT)} bytes of "
                                       f"workgroup memory for the block scores, the device has "
                                       f"{ctx.workgroup_storage} [R18]")
            DCV = fits[0]
            pipe, bgl = self._ib_pipeline(SCORES, f16, {"DV": DV, "S": S, "BS": BS, "DCV": DCV, "RT": RT,
                                                        **layout.kernel_constants()})

        per_q = max(Hkv * DV * 16, Hkv * msb * 4)
        # a batch of queries: its index queries, its outputs and its query_end plus >= 1 work item fit
        step = min(ctx.binding_size // per_q, ctx.binding_size // 4 - 8)
        if step < 1:
            raise UnsupportedError(f"{fn}(): backend 'wgpu' needs {per_q} bytes per query (Hkv={Hkv}, msb={msb}, "
                                   f"d_idx={d}), more than one storage binding ({ctx.binding_size} bytes) [R18]")
        heads = [(0, Hkv, 0)] if Hk == 1 else [(h, 1, h) for h in range(Hkv)]  # (h_off, nh, hk)

        def plan(ta: int, tb: int) -> list[np.ndarray]:
            """Work items [n, 8] of queries [ta, tb) for every chunk."""
            per_chunk = [[] for _ in range(nch)]
            for b in np.flatnonzero((cu[1:] > ta) & (cu[:-1] < tb) & (nblk > 0)):
                ts, te = max(int(cu[b]), ta), min(int(cu[b + 1]), tb)
                L = int(lens[b])
                s = np.arange(int(nblk[b]), dtype=np.int64)
                for h_off, nh, hk in heads:
                    nr = (te - ts) * nh
                    r0 = np.arange(0, nr, RT, dtype=np.int64)
                    n_rows = np.minimum(RT, nr - r0)
                    last_end = qend[ts + (r0 + n_rows - 1) // nh]  # query_end grows within a sequence
                    npos = np.minimum(np.minimum(BS, L - s * BS)[None, :], last_end[:, None] - s[None, :] * BS)
                    for c in range(nch):
                        in_c = (pch[b, s, hk] == c).any(axis=-1)  # the block has a page in chunk c
                        ri, si = np.nonzero((npos > 0) & in_c[None, :])
                        if ri.size == 0:
                            continue
                        ss = s[si]
                        per_chunk[c].append(np.stack([
                            np.full(ri.size, ts - ta), r0[ri], n_rows[ri], np.full(ri.size, nh),
                            np.full(ri.size, h_off), ((b * msb + ss) * Hk + hk) * ppb, npos[ri, si], ss], axis=1))
            return [np.concatenate(x) if x else np.zeros((0, 8), np.int64) for x in per_chunk]

        return SimpleNamespace(ik=ik, resident=resident, layout=layout, starts=starts, nch=nch, pt=pt, DCV=DCV, DV=DV,
                               f16=f16, pipe=pipe, bgl=bgl, step=step, plan=plan, qend=qend, ipw=ipw, kernel=kernel)

    def _block_scores_run(self, p, st) -> np.ndarray:
        Tq, Hkv, d = p.index_q.shape
        msb, nch, starts, layout, ik, resident, step, plan, qend = (p.msb, st.nch, st.starts, st.layout, st.ik,
                                                                     st.resident, st.step, st.plan, st.qend)
        pt, pipe, bgl, DV = st.pt, st.pipe, st.bgl, st.DV
        ctx = self._device()
        out = np.empty((Tq, Hkv, msb), dtype=np.float32)  # every batch's rows are read back into it
        if d == DV * 4:
            iq = np.ascontiguousarray(p.index_q, dtype=np.float32)
        else:  # the rows padded to whole vec4s
            iq = np.zeros((Tq, Hkv, DV * 4), dtype=np.float32)
            iq[:, :, :d] = p.index_q
        run = _Run(ctx, self._max_bytes is None, cache_bind_groups=resident, pinned=self._pinned)
        sizes = dict(Tq=Tq, Hkv=Hkv, msb=msb, d_idx=d, chunks=nch)
        try:
            with device_errors("wgpu block_scores", **sizes):
                kbufs = ik.buffers() if resident else upload_slabs(ctx.device, np.asarray(ik), layout,
                                                                    "index_k_cache")
                if not resident:
                    run.owned.extend(kbufs)
                pbuf = run.data(pt, "pages")
                maxdim = ctx.workgroups_per_dim
                scale = float(p.softmax_scale)
                flat = out.reshape(Tq, -1)
                kpipe, kbgl = self._ib_pipeline(KEY_DECODE, False, {"WG": KEY_DECODE_WG})
                for ta in range(0, Tq, step):
                    tb = min(Tq, ta + step)
                    nq = tb - ta
                    qend_w = qend[ta:tb].astype(np.int32).view(np.uint32)
                    per_plan = (ctx.binding_size // 4 - nq) // 8  # work items one plan buffer holds
                    qbuf = run.data(iq[ta:tb], "index_q")
                    obuf = run.output(nq * Hkv * msb * 4, "scores")
                    for c, items in enumerate(plan(ta, tb)):
                        for i0 in range(0, items.shape[0], per_plan):
                            part = items[i0:i0 + per_plan]
                            plbuf = run.data(np.concatenate([qend_w, part.astype(np.uint32).reshape(-1)]), "plan")
                            for f2, cnt, gx, gy in score_dispatches(part.shape[0], st.ipw, maxdim):
                                rec = _record(f2, cnt, gx, nq, Hkv, msb, scale, int(starts[c]), int(starts[c + 1]))
                                run.dispatch(pipe, bgl, [qbuf, kbufs[c], pbuf, plbuf, obuf], rec, gx, gy)
                    for rec, gx, gy in key_decode_dispatches(nq * Hkv * msb, maxdim):
                        run.dispatch(kpipe, kbgl, [obuf], rec, gx, gy)

                    def sink(raw, ta=ta, tb=tb):  # float32 bits (psa_score_keys.wgsl)
                        flat[ta:tb] = raw.view(np.float32).reshape(tb - ta, -1)

                    run.read(obuf, nq * Hkv * msb * 4, sink)
                run.submit()
        finally:
            run.close()
        return out

    # --- top-k -----------------------------------------------------------------------------------

    def _select_topk_locked(self, p) -> np.ndarray:
        fn = "select_topk"
        Tq, Hkv, msb = p.scores.shape
        k = p.topk
        out = np.full((Tq, Hkv, k), -1, dtype=np.int32)
        if k == 0 or Tq * Hkv == 0:
            return out
        ctx = self._device()
        k_out = min(k, msb)  # a row holds at most msb distinct ids; the rest is -1 padding
        per_q = Hkv * max(msb, k_out) * 4
        if per_q > ctx.binding_size:
            raise UnsupportedError(f"{fn}(): backend 'wgpu' needs {per_q} bytes per query (Hkv={Hkv}, "
                                   f"msb={msb}), more than one storage binding ({ctx.binding_size} bytes) [R18]")
        if topk_cap(ctx) < 1:
            raise UnsupportedError(f"{fn}(): backend 'wgpu' needs more than {ctx.workgroup_storage} bytes of "
                                   "workgroup memory [R18]")
        entry, consts = topk_pipeline_args(ctx, False, msb, Tq * Hkv)
        pipe, bgl = self._ib_pipeline(TOPK, False, consts, entry)
        bits = p.scores.view(np.uint32).reshape(Tq, Hkv * msb)
        local = p.local_block.astype(np.int32)
        res = np.empty((Tq, Hkv * k_out), dtype=np.int32)
        step = max(1, ctx.binding_size // per_q)
        maxdim = ctx.workgroups_per_dim
        run = _Run(ctx, self._max_bytes is None, cache_bind_groups=True, pinned=self._pinned)
        try:
            with device_errors("wgpu select_topk", Tq=Tq, Hkv=Hkv, msb=msb, topk=k):
                for ta in range(0, Tq, step):
                    tb = min(Tq, ta + step)
                    rows = (tb - ta) * Hkv
                    sbuf = run.data(bits[ta:tb], "scores")
                    lbuf = run.data(local[ta:tb], "local_block")
                    obuf = run.output(rows * k_out * 4, "selected")
                    for f2, cnt, gx, gy in grid_dispatches(rows, maxdim):
                        rec = topk_record(f2, cnt, gx, msb, k_out, Hkv)
                        run.dispatch(pipe, bgl, [sbuf, lbuf, obuf], rec, gx, gy)

                    def sink(raw, ta=ta, tb=tb):
                        res[ta:tb] = raw.view(np.int32).reshape(tb - ta, -1)

                    run.read(obuf, rows * k_out * 4, sink)
                run.submit()
        finally:
            run.close()
        out[:, :, :k_out] = res.reshape(Tq, Hkv, k_out)
        return out
