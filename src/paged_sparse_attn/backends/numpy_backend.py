"""The numpy backend: the KV-outer algorithm (R13-R15), vectorised.

Slot groups (all edges of one (KV head, block)) are bucketed by their edge count into powers of
two; a bucket is processed in chunks with batched matmuls: the block's K/V is gathered once per
slot group and multiplied against the queries of all its edges and all G heads of the group.

Scores and partials accumulate in float32 (BLAS sgemm); float16/bfloat16 caches are converted to
float32 after the gather (exact). Masked positions are removed with ``where`` before the softmax;
V rows that are not attended are zeroed before ``P @ V``, and if a slot's attended V holds NaN/Inf
the chunk takes an exact masked path so that only rows attending it see it (R10).
"""

from __future__ import annotations

import numpy as np

from .._types import Availability, Capabilities, DeviceArray, KVOuterIndex, Partials, Problem
from ..errors import UnsupportedError
from .._validation import FLOAT_DTYPES
from .base import Backend

__all__ = ["NumpyBackend"]

# Elements (float32) a chunk's score tensor may hold: bounds temporary memory to ~100 MB.
_CHUNK_ELEMS = 1 << 23


class NumpyBackend(Backend):
    """Pure-numpy KV-outer backend: always available, deterministic (R19), float32 accumulation.

    Thread safety: stateless; safe to call from several threads at once.
    """

    name = "numpy"

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, f"ok: numpy {np.__version__} on the CPU")

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=tuple(d.name for d in FLOAT_DTYPES),
            device_arrays=False,
            deterministic=True,
            device="cpu (numpy)",
        )

    def forward_partials(self, problem: Problem, index: KVOuterIndex) -> Partials:
        for arr in (problem.k_cache, problem.v_cache):
            if isinstance(arr, DeviceArray):
                raise UnsupportedError(
                    "backend 'numpy' cannot read a device-resident cache; pass numpy arrays or use "
                    f"the backend that holds it ({arr.backend!r}) [R18]"
                )
        return kvouter_partials(problem.q, problem.k_cache, problem.v_cache, index, problem.softmax_scale)

    # index branch (R21-R24) lives in its own module
    def block_scores(self, problem):
        from ..index_branch.numpy_impl import block_scores_numpy

        return block_scores_numpy(problem)

    def select_topk(self, problem):
        from ..index_branch.numpy_impl import select_topk_numpy

        return select_topk_numpy(problem)


def _buckets(counts: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Group slot ids by edge count rounded up to a power of two: [(n_max, slot_ids)]."""
    if counts.size == 0:
        return []
    cap = np.left_shift(1, np.ceil(np.log2(np.maximum(counts, 1))).astype(np.int64))
    out = []
    for n in np.unique(cap):
        out.append((int(n), np.flatnonzero(cap == n)))
    return out


def kvouter_partials(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, index: KVOuterIndex,
                     scale: float) -> Partials:
    """Compute R14 partials for every edge of ``index``; see the module docstring."""
    Tq, Hq, D = q.shape
    Hkv = index.num_kv_heads
    G = Hq // Hkv
    E = index.num_edges
    BS, S = index.block_size, index.page_size
    ppb = BS // S
    o = np.zeros((E, G, D), dtype=np.float32)
    m = np.full((E, G), -np.inf, dtype=np.float32)
    l = np.zeros((E, G), dtype=np.float32)
    if E == 0:
        return Partials(o, m, l)

    qg = q.reshape(Tq, Hkv, G, D)
    if qg.dtype != np.float32:
        qg = qg.astype(np.float32)
    counts = np.diff(index.slot_ptr).astype(np.int64)
    lens = index.used_kv_lens.astype(np.int64)
    offs = np.arange(BS, dtype=np.int64)
    for n_max, slots in _buckets(counts):
        per_slot = max(1, n_max * G * BS, n_max * G * D)
        step = max(1, _CHUNK_ELEMS // per_slot)
        for c0 in range(0, slots.shape[0], step):
            sl = slots[c0:c0 + step]
            _slot_chunk(qg, k_cache, v_cache, index, scale, sl, n_max, counts, lens, offs, ppb, S, o, m, l)
    return Partials(o, m, l)


def _slot_chunk(qg, k_cache, v_cache, index, scale, sl, n_max, counts, lens, offs, ppb, S, o, m, l):
    ns = sl.shape[0]
    G, D = qg.shape[2], qg.shape[3]
    BS = ppb * S
    h = index.slot_head[sl].astype(np.int64)
    b = index.slot_seq[sl].astype(np.int64)
    s = index.slot_block[sl].astype(np.int64)

    # --- gather the block's K/V once per slot group ---------------------------------------
    pages = index.block_tables[b[:, None], s[:, None] * ppb + np.arange(ppb)]  # [ns, ppb]
    mapped = pages >= 0
    # positions valid for every edge of the slot: mapped page and < L_b (R10)
    valid = np.repeat(mapped, S, axis=1) & (s[:, None] * BS + offs[None, :] < lens[b][:, None])  # [ns, BS]
    safe_pages = np.where(mapped, pages, 0)
    K = k_cache[safe_pages, h[:, None]].reshape(ns, BS, D)  # [ns, ppb, S, D] -> [ns, BS, D]
    V = v_cache[safe_pages, h[:, None]].reshape(ns, BS, D)
    K = np.where(valid[..., None], K, 0).astype(np.float32, copy=False)
    V = np.where(valid[..., None], V, 0).astype(np.float32, copy=False)

    # --- the slot's edges, padded to n_max ---------------------------------------------------
    e = index.slot_ptr[sl].astype(np.int64)[:, None] + np.arange(n_max)  # [ns, n_max]
    live = np.arange(n_max)[None, :] < counts[sl][:, None]
    e = np.where(live, e, index.slot_ptr[sl].astype(np.int64)[:, None])
    t = index.edge_query[e]
    Q = qg[t, h[:, None]]  # [ns, n_max, G, D]

    # --- scores, masked softmax, partials ----------------------------------------------------
    sc = np.matmul(Q.reshape(ns, n_max * G, D), K.transpose(0, 2, 1)).reshape(ns, n_max, G, BS)
    sc *= np.float32(scale)
    att = valid[:, None, :] & (offs[None, None, :] < index.edge_len[e][..., None])  # [ns, n_max, BS]
    sc = np.where(att[:, :, None, :], sc, -np.inf)
    mx = sc.max(axis=-1)  # [ns, n_max, G]; -inf if the edge attends nothing
    any_att = att.any(axis=-1)[..., None]
    with np.errstate(invalid="ignore"):
        p = np.exp(sc - np.where(any_att, mx, 0)[..., None])  # masked -> exp(-inf) = 0
    lsum = p.sum(axis=-1)
    ov = np.matmul(p.reshape(ns, n_max * G, BS), V).reshape(ns, n_max, G, D)

    # V that is attended by some edge of the slot but not by others may hold NaN/Inf: P @ V
    # would then turn 0 * NaN into NaN for the edges that do not attend it. Redo those slots
    # exactly (rare: only with non-finite data).
    bad = ~np.isfinite(V).all(axis=-1)  # [ns, BS]
    if bad.any():
        for j in np.flatnonzero(bad.any(axis=-1)):
            Vj = v_cache[safe_pages[j], h[j]].reshape(BS, D).astype(np.float32)
            for r in range(n_max):
                a = att[j, r]
                ov[j, r] = p[j, r][:, a] @ Vj[a] if a.any() else 0

    idx = e[live]
    o[idx] = ov[live]
    m[idx] = mx[live]
    l[idx] = lsum[live]
