"""The numpy backend: the KV-outer algorithm (R13-R15), vectorised.

Slot groups (all edges of one (KV head, block)) are padded to the next power of two of their
edge count and cut into chunks of one padded count; a chunk is processed with batched matmuls:
the block's K/V is gathered once per slot group and multiplied against the queries of all its
edges and all G heads of the group. Every matmul's shape depends on one slot's own sequence
only, so a row's bits do not depend on the rest of the batch (R27).

Scores and partials accumulate in float32 (BLAS sgemm); float16/bfloat16 caches are converted to
float32 after the gather (exact). Masked positions are removed with ``where`` before the softmax;
V rows that no edge of the slot may attend are zeroed before ``P @ V``, and if a slot's attended V holds NaN/Inf
the slot takes an exact masked path so that only rows attending it see it (R10) and positions
whose score is -inf pass nothing on (R26).
"""

from __future__ import annotations

import numpy as np

from .._types import AttentionInputs, Availability, Capabilities, DeviceArray, KVOuterIndex, Partials
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
    description = "The spec's reference backend: vectorised numpy on the CPU, float32 accumulation"

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, f"ok: numpy {np.__version__} on the CPU")

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=tuple(d.name for d in FLOAT_DTYPES),
            device_arrays=False,
            deterministic=True,
            batch_invariant=True,
            index_branch=True,
            kv_layouts=("HND", "NHD"),
            device="cpu (numpy)",
        )

    @staticmethod
    def _check_host(problem: AttentionInputs) -> None:
        for arr in (problem.k_cache, problem.v_cache):
            if isinstance(arr, DeviceArray):
                raise UnsupportedError(
                    "backend 'numpy' cannot read a device-resident cache; pass numpy arrays or use "
                    f"the backend that holds it ({arr.backend!r}) [R18]"
                )

    def forward_partials(self, problem: AttentionInputs, index: KVOuterIndex) -> Partials:
        self._check_host(problem)
        k, v = hnd_views(problem)
        return kvouter_partials(problem.q, k, v, index, problem.softmax_scale)[0]

    def forward(self, problem: AttentionInputs, index: KVOuterIndex) -> tuple[np.ndarray, np.ndarray]:
        """Partials then combine, without scattering o into edge order: each chunk's P @ V
        writes straight into a padded buffer and the combine reads it through a row map."""
        if type(self).forward_partials is not NumpyBackend.forward_partials:
            return super().forward(problem, index)  # a subclass's partials must be the ones used
        self._check_host(problem)
        k, v = hnd_views(problem)
        parts, o_row = kvouter_partials(problem.q, k, v, index, problem.softmax_scale, padded=True)
        from .._combine import combine_partials_numpy

        return combine_partials_numpy(parts, index, o_row=o_row)

    # index branch (R21-R25) lives in its own module
    def block_scores(self, problem):
        from .numpy_index import block_scores_numpy

        return block_scores_numpy(problem)

    def select_topk(self, problem):
        from .numpy_index import select_topk_numpy

        return select_topk_numpy(problem)


def hnd_view(cache: np.ndarray, kv_layout: str) -> np.ndarray:
    """``cache`` indexed as ``[P, Hkv, S, D]`` whatever its page layout (R34): for ``"NHD"`` a
    transposed *view* of the caller's memory (strides swapped, nothing copied). The gathers read
    the same elements either way, so every later float operation and its result are the same."""
    return cache if kv_layout == "HND" else cache.transpose(0, 2, 1, 3)


def hnd_views(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    return hnd_view(problem.k_cache, problem.kv_layout), hnd_view(problem.v_cache, problem.kv_layout)


def _chunks(counts: np.ndarray, G: int, BS: int, D: int) -> list[tuple[int, np.ndarray]]:
    """Slot ids grouped by their padded edge count, cut into chunks of bounded size.

    A slot's edges are padded to the next power of two of its own edge count, and a chunk holds
    slots of one padded count only: each slot's matmuls then have a shape that depends on its
    own sequence alone. BLAS may pick its kernel by the shape, so a shape set by the other
    sequences of the batch could change a row's bits (R27); powers of two keep the padding below
    2x and the number of chunks small. Returns ``[(n_padded, slot_ids)]``.
    """
    padded = np.where(counts > 1, 1 << np.ceil(np.log2(np.maximum(counts, 1))).astype(np.int64), 1)
    order = np.argsort(-padded, kind="stable")
    sorted_pad = padded[order]
    starts = np.flatnonzero(np.diff(sorted_pad, prepend=-1))  # where the padded count changes
    out = []
    for a, z in zip(starts, [*starts[1:], order.shape[0]]):
        n = int(sorted_pad[a])
        step = max(1, _CHUNK_ELEMS // max(1, n * G * max(BS, D)))
        out.extend((n, order[i:min(i + step, z)]) for i in range(a, z, step))
    return out


def kvouter_partials(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, index: KVOuterIndex,
                     scale: float, *, padded: bool = False) -> tuple[Partials, np.ndarray | None]:
    """Compute R14 partials for every edge of ``index``; see the module docstring.

    Returns ``(partials, o_row)``. With ``padded=False``, ``partials.o`` is [E, G, D] in edge
    order and ``o_row`` is None. With ``padded=True``, ``partials.o`` is the chunks' padded output
    buffer and edge e's rows are ``partials.o[o_row[e]]`` (no scatter into edge order).
    """
    Tq, Hq, D = q.shape
    Hkv = index.num_kv_heads
    G = Hq // Hkv
    E = index.num_edges
    BS, S = index.block_size, index.page_size
    ppb = BS // S
    m = np.full((E, G), -np.inf, dtype=np.float32)
    l = np.zeros((E, G), dtype=np.float32)
    if E == 0 or k_cache.shape[0] == 0:  # P = 0: every page is unmapped (R2), every edge empty
        return Partials(np.zeros((E, G, D), dtype=np.float32), m, l), (np.arange(E) if padded else None)

    # fold the scale into q once, instead of into every score
    with np.errstate(over="ignore", invalid="ignore"):  # inf * 0 is NaN, as R26 says: no warning
        qg = q.reshape(Tq, Hkv, G, D).astype(np.float32) * np.float32(scale)
    counts = np.diff(index.slot_ptr).astype(np.int64)
    lens = index.used_kv_lens.astype(np.int64)
    offs = np.arange(BS, dtype=np.int64)
    # NaN/Inf in attended data propagate to their rows only (IEEE), silently as in numpy's
    # own reductions; masked positions never reach the arithmetic.
    chunks = _chunks(counts, G, BS, D)
    if padded:
        o = np.empty((sum(sl.shape[0] * n for n, sl in chunks), G, D), dtype=np.float32)
        o_row = np.empty(E, dtype=np.int64)
    else:
        o, o_row = np.zeros((E, G, D), dtype=np.float32), None
    with np.errstate(invalid="ignore", over="ignore"):
        off = 0
        for n_max, sl in chunks:
            dest = o[off:off + sl.shape[0] * n_max] if padded else None
            _slot_chunk(qg, k_cache, v_cache, index, sl, n_max, counts, lens, offs, ppb, S, o, m, l,
                        dest=dest, o_row=o_row, off=off)
            off += sl.shape[0] * n_max
    return Partials(o, m, l), o_row


def _slot_chunk(qg, k_cache, v_cache, index, sl, n_max, counts, lens, offs, ppb, S, o, m, l, *,
                dest=None, o_row=None, off=0):
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
    K = K.astype(np.float32, copy=False)  # the gather made a copy: safe to edit in place
    V = V.astype(np.float32, copy=False)
    if not valid.all():
        invalid = ~valid
        K[invalid] = 0  # never let unmapped pages or positions >= L_b be read (R10)
        V[invalid] = 0

    # --- the slot's edges, padded to n_max ---------------------------------------------------
    e = index.slot_ptr[sl].astype(np.int64)[:, None] + np.arange(n_max)  # [ns, n_max]
    live = np.arange(n_max)[None, :] < counts[sl][:, None]
    e = np.where(live, e, index.slot_ptr[sl].astype(np.int64)[:, None])
    t = index.edge_query[e]
    Q = qg[t, h[:, None]]  # [ns, n_max, G, D]

    # --- scores, masked softmax, partials (in place: the score tensor is the big one) ---------
    sc = np.matmul(Q.reshape(ns, n_max * G, D), K.transpose(0, 2, 1)).reshape(ns, n_max, G, BS)
    att = valid[:, None, :] & (offs[None, None, :] < index.edge_len[e][..., None])  # [ns, n_max, BS]
    np.copyto(sc, -np.inf, where=~att[:, :, None, :])
    # V that is attended by some edge of the slot but not by others may hold NaN/Inf: P @ V
    # would then turn 0 * NaN into NaN for the edges that do not attend it (R10), and a position
    # whose score is -inf must not pass its value on either (R26). Those slots are redone
    # exactly below (rare: only with non-finite data); keep their -inf pattern for that.
    bad = ~np.isfinite(V.sum(axis=-1))  # [ns, BS]; a false alarm (overflow) only costs time
    redo = np.flatnonzero(bad.any(axis=-1))
    dropped = {int(j): sc[j] == -np.inf for j in redo}  # [n_max, G, BS]: masked or -inf score
    mx = sc.max(axis=-1)  # [ns, n_max, G]; -inf if nothing attended has a score above -inf
    # R26: an edge whose scores are all -inf is empty (m = -inf, l = 0, o = 0); NaN and +inf
    # maxima propagate (inf - inf = NaN)
    np.subtract(sc, np.where(mx == -np.inf, 0, mx)[..., None], out=sc)
    p = np.exp(sc, out=sc)  # masked -> exp(-inf) = 0
    # Flush subnormal weights to 0: they change no float32 result (l >= 1) but make sgemm crawl.
    np.copyto(p, 0, where=p < np.finfo(np.float32).tiny)
    lsum = p.sum(axis=-1)
    if dest is None:
        ov = np.matmul(p.reshape(ns, n_max * G, BS), V).reshape(ns, n_max, G, D)
    else:  # write straight into the caller's padded buffer
        ov = np.matmul(p.reshape(ns, n_max * G, BS), V, out=dest.reshape(ns, n_max * G, D)).reshape(ns, n_max, G, D)

    for j in redo:  # exact P @ V over each head's kept positions only
        Vj = v_cache[safe_pages[j], h[j]].reshape(BS, D).astype(np.float32)
        for r in range(n_max):
            for g in range(G):
                keep = ~dropped[int(j)][r, g]
                ov[j, r, g] = p[j, r, g][keep] @ Vj[keep] if keep.any() else 0

    idx = e[live]
    if dest is None:
        o[idx] = ov[live]
    else:
        o_row[idx] = off + np.flatnonzero(live.ravel())
    m[idx] = mx[live]
    l[idx] = lsum[live]
