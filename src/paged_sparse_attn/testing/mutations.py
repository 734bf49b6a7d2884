"""The catalogue of single-rule violations of the public functions' inputs (R17).

:data:`MUTATIONS` maps every rule an input of ``forward`` can break (R1-R8, R34) to functions that take a valid
:class:`~paged_sparse_attn.testing.problem.AttentionProblem` and return the arguments to change
so that exactly that rule is violated, with a sentence saying how (or None when the mutation
does not apply to that problem). :func:`paged_sparse_attn.testing.strategies.invalid_problems`
draws from it. :data:`INDEX_MUTATIONS` does the same for the rules only the index branch's
inputs can break (R21, R23, R25), as calls of ``sparse_attention``
(:func:`~paged_sparse_attn.testing.strategies.invalid_index_problems`). The catalogue needs
neither hypothesis nor pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .problem import AttentionProblem

__all__ = ["RULES", "MUTATIONS", "Mutation", "Pick", "INDEX_RULES", "INDEX_MUTATIONS", "IndexMutation"]

RULES = ("R1", "R2", "R3", "R4", "R5", "R6", "R7", "R8", "R34")
"""The rules an input of ``forward`` can break; each has at least one mutation."""

Pick = Callable[[int, int], int]  # pick(lo, hi): an int in [lo, hi], drawn by hypothesis
Mutation = Callable[[AttentionProblem, Pick], "tuple[dict, str] | None"]


def _arr(p: AttentionProblem, name: str) -> np.ndarray:
    return np.array(getattr(p, name) if name != "used_kv_lens" else p.kv_lens.astype(np.int32))


def _r1_q_2d(p, pick):
    return {"q": np.ascontiguousarray(p.q[:, 0, :])}, "q is 2-D"


def _r1_cache_3d(p, pick):
    return {"k_cache": np.ascontiguousarray(p.k_cache[:, 0]), "v_cache": np.ascontiguousarray(p.v_cache[:, 0])}, \
        "k_cache and v_cache are 3-D"


def _r1_kv_shapes_differ(p, pick):
    extra = np.zeros((1, *p.v_cache.shape[1:]), dtype=p.v_cache.dtype)
    return {"v_cache": np.concatenate([p.v_cache, extra])}, "v_cache has one page more than k_cache"


def _r1_kv_dtypes_differ(p, pick):
    other = np.float16 if np.dtype(p.k_cache.dtype) != np.float16 else np.float32
    return {"v_cache": p.v_cache.astype(other)}, f"v_cache is {np.dtype(other).name}, k_cache is not"


def _r1_head_dim(p, pick):
    q = np.concatenate([p.q, np.zeros((*p.q.shape[:2], 1), dtype=p.q.dtype)], axis=2)
    return {"q": q}, f"q has head_dim {p.head_dim + 1}, the caches {p.head_dim}"


def _r1_group(p, pick):
    if p.num_kv_heads < 2:
        return None
    q = np.concatenate([p.q, np.zeros((p.q.shape[0], 1, p.q.shape[2]), dtype=p.q.dtype)], axis=1)
    return {"q": q}, f"Hq={p.num_q_heads + 1} is not a multiple of Hkv={p.num_kv_heads}"


def _r1_no_kv_heads(p, pick):
    shape = (p.num_pages, 0, p.page_size, p.head_dim)
    return {"k_cache": np.zeros(shape, p.k_cache.dtype), "v_cache": np.zeros(shape, p.v_cache.dtype)}, \
        "the caches have 0 KV heads"


def _r1_page_size_zero(p, pick):
    shape = (p.num_pages, p.num_kv_heads, 0, p.head_dim)
    return {"k_cache": np.zeros(shape, p.k_cache.dtype), "v_cache": np.zeros(shape, p.v_cache.dtype)}, \
        "the caches have page size 0"


def _r2_below(p, pick):
    bt = _arr(p, "block_tables")
    b, j = pick(0, bt.shape[0] - 1), pick(0, bt.shape[1] - 1)
    bt[b, j] = -pick(2, 5)
    return {"block_tables": bt}, f"block_tables[{b}, {j}] = {int(bt[b, j])} < -1"


def _r2_above(p, pick):
    bt = _arr(p, "block_tables")
    b, j = pick(0, bt.shape[0] - 1), pick(0, bt.shape[1] - 1)
    bt[b, j] = p.num_pages + pick(0, 3)
    return {"block_tables": bt}, f"block_tables[{b}, {j}] = {int(bt[b, j])} >= P={p.num_pages}"


def _r2_1d(p, pick):
    return {"block_tables": _arr(p, "block_tables").reshape(-1)}, "block_tables is 1-D"


def _r3_first(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    cu[0] = pick(1, 3)
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q[0] = {int(cu[0])}"


def _r3_last(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    cu[-1] += pick(1, 3)
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q[-1] = {int(cu[-1])} != Tq={p.num_queries}"


def _r3_decreasing(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    if cu.shape[0] < 3:
        return None
    j = pick(1, cu.shape[0] - 2)
    cu[j] = cu[j + 1] + pick(1, 2)
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q decreases at [{j}, {j + 1}]"


def _r3_length(p, pick):
    cu = _arr(p, "cu_seqlens_q")
    cu = np.append(cu, cu[-1]) if pick(0, 1) or cu.shape[0] < 2 else cu[1:]
    return {"cu_seqlens_q": cu}, f"cu_seqlens_q has {cu.shape[0]} entries, B+1={p.num_seqs + 1}"


def _r3_2d(p, pick):
    return {"cu_seqlens_q": _arr(p, "cu_seqlens_q")[None, :]}, "cu_seqlens_q is 2-D"


def _r4_negative(p, pick):
    lens = _arr(p, "used_kv_lens")
    b = pick(0, lens.shape[0] - 1)
    lens[b] = -pick(1, 4)
    return {"used_kv_lens": lens}, f"used_kv_lens[{b}] = {int(lens[b])} < 0"


def _r4_too_long(p, pick):
    lens = _arr(p, "used_kv_lens")
    b = pick(0, lens.shape[0] - 1)
    lens[b] = p.msb * p.block_size + pick(1, 4)
    return {"used_kv_lens": lens}, f"used_kv_lens[{b}] = {int(lens[b])} > msb*block_size"


def _r4_length(p, pick):
    lens = _arr(p, "used_kv_lens")
    return {"used_kv_lens": np.append(lens, 0)}, f"used_kv_lens has B+1={p.num_seqs + 1} entries"


def _r5_not_positive(p, pick):
    bs = -p.page_size * pick(0, 2)
    return {"block_size": bs}, f"block_size = {bs}"


def _r5_not_multiple(p, pick):
    if p.page_size < 2:
        return None
    bs = p.block_size + pick(1, p.page_size - 1)
    return {"block_size": bs}, f"block_size = {bs} is not a multiple of page_size={p.page_size}"


def _r5_not_int(p, pick):
    bad = [float(p.block_size), True, None, str(p.block_size)][pick(0, 3)]
    return {"block_size": bad}, f"block_size = {bad!r}"


def _r5_msb_zero(p, pick):
    # msb = max_pages // ppb = 0; the selection and the lengths are made consistent with msb = 0
    bs = p.page_size * (p.block_tables.shape[1] + pick(1, 2))
    return {"block_size": bs, "selected": np.full_like(p.selected, -1),
            "used_kv_lens": np.zeros(p.num_seqs, dtype=np.int32)}, f"block_size = {bs} leaves msb = 0"


def _sel_with_slot(p):
    """``selected`` with one more (padding) column, so that any row has a free slot."""
    return np.concatenate([p.selected, np.full((*p.selected.shape[:2], 1), -1, np.int32)], axis=2)


def _r6_too_big(p, pick):
    if p.num_queries == 0:
        return None
    sel = _sel_with_slot(p)
    t, h = pick(0, sel.shape[0] - 1), pick(0, sel.shape[1] - 1)
    sel[t, h, -1] = p.msb + pick(0, 3)
    return {"selected": sel}, f"selected[{t}, {h}, -1] = {int(sel[t, h, -1])} >= msb={p.msb}"


def _r6_below(p, pick):
    if p.num_queries == 0:
        return None
    sel = _sel_with_slot(p)
    t, h = pick(0, sel.shape[0] - 1), pick(0, sel.shape[1] - 1)
    sel[t, h, -1] = -pick(2, 5)
    return {"selected": sel}, f"selected[{t}, {h}, -1] = {int(sel[t, h, -1])} < -1"


def _r6_duplicate(p, pick):
    if p.num_queries == 0:
        return None
    sel = np.concatenate([_sel_with_slot(p), np.full((*p.selected.shape[:2], 1), -1, np.int32)], axis=2)
    t, h = pick(0, sel.shape[0] - 1), pick(0, sel.shape[1] - 1)
    s = pick(0, p.msb - 1)
    row = sel[t, h]
    row[row == s] = -1  # place s exactly twice, in the two new slots
    row[-2:] = s
    return {"selected": sel}, f"selected[{t}, {h}] repeats block id {s}"


def _r6_shape(p, pick):
    sel = _arr(p, "selected")
    if pick(0, 1):
        sel = np.concatenate([sel, np.full((1, *sel.shape[1:]), -1, np.int32)], axis=0)
        return {"selected": sel}, f"selected has {sel.shape[0]} rows, Tq={p.num_queries}"
    sel = np.concatenate([sel, np.full((sel.shape[0], 1, sel.shape[2]), -1, np.int32)], axis=1)
    return {"selected": sel}, f"selected has {sel.shape[1]} heads, Hkv={p.num_kv_heads}"


def _r6_2d(p, pick):
    return {"selected": _arr(p, "selected")[:, 0, :]}, "selected is 2-D"


def _r7_float64_q(p, pick):
    return {"q": p.q.astype([np.float64, np.int32, np.complex64][pick(0, 2)])}, "q has a non-float dtype"


def _r7_float64_cache(p, pick):
    dt = [np.float64, np.int16][pick(0, 1)]
    return {"k_cache": p.k_cache.astype(dt), "v_cache": p.v_cache.astype(dt)}, \
        f"k_cache and v_cache are {np.dtype(dt).name}"


def _r7_float_index(p, pick):
    name = ["block_tables", "selected", "cu_seqlens_q", "used_kv_lens"][pick(0, 3)]
    return {name: _arr(p, name).astype(np.float64)}, f"{name} is float64"


def _r7_bool_index(p, pick):
    name = ["block_tables", "selected"][pick(0, 1)]
    return {name: _arr(p, name) >= 0}, f"{name} is bool"


def _r7_list(p, pick):
    # nested lists are read with numpy's inferred dtype: Python floats become float64 (refused)
    name = ["q", "k_cache"][pick(0, 1)]
    if np.asarray(getattr(p, name)).size == 0:
        return None  # an empty nested list loses its shape: that would be R1
    return {name: np.asarray(getattr(p, name), dtype=np.float64).tolist()}, f"{name} is a list of Python floats"


def _r7_int32_overflow(p, pick):
    # Values beyond int32 also break the range rule of the array; R7 is checked first because
    # every later check works on int32 (so the violation is reported as R7).
    name = ["block_tables", "used_kv_lens"][pick(0, 1)]
    a = _arr(p, name).astype(np.int64)
    a.flat[pick(0, a.size - 1)] = 2**31 + pick(0, 10)
    return {name: a}, f"{name} holds a value that does not fit int32"


def _r8_scale(p, pick):
    bad = [float("nan"), float("inf"), -float("inf"), "0.5", True, np.array([0.5])][pick(0, 5)]
    return {"softmax_scale": bad}, f"softmax_scale = {bad!r}"


def _r8_causal(p, pick):
    bad = [1, 0, "yes", None, np.array([True])][pick(0, 4)]
    return {"causal": bad}, f"causal = {bad!r}"


def _r34_kv_layout(p, pick):
    bad = ["nhd", "hnd", "NHD ", "HDN", "", None, 1, ("NHD",)][pick(0, 7)]
    return {"kv_layout": bad}, f"kv_layout = {bad!r}"


MUTATIONS: dict[str, tuple[Mutation, ...]] = {
    "R1": (_r1_q_2d, _r1_cache_3d, _r1_kv_shapes_differ, _r1_kv_dtypes_differ, _r1_head_dim, _r1_group,
           _r1_no_kv_heads, _r1_page_size_zero),
    "R2": (_r2_below, _r2_above, _r2_1d),
    "R3": (_r3_first, _r3_last, _r3_decreasing, _r3_length, _r3_2d),
    "R4": (_r4_negative, _r4_too_long, _r4_length),
    "R5": (_r5_not_positive, _r5_not_multiple, _r5_not_int, _r5_msb_zero),
    "R6": (_r6_too_big, _r6_below, _r6_duplicate, _r6_shape, _r6_2d),
    "R7": (_r7_float64_q, _r7_float64_cache, _r7_float_index, _r7_bool_index, _r7_list, _r7_int32_overflow),
    "R8": (_r8_scale, _r8_causal),
    "R34": (_r34_kv_layout,),
}
"""The catalogue of single-rule violations: rule id -> mutations of a valid problem."""




# --- the index branch: violations of sparse_attention's own rules (R21, R23, R25) -------------

INDEX_RULES = ("R21", "R23", "R25")
"""The rules only an input of the index branch can break; each has at least one mutation."""

IndexMutation = Callable[[Any, Pick], "tuple[dict, str] | None"]  # (IndexCase, pick) -> changes


def _r21_index_q_2d(c, pick):
    return {"index_q": np.ascontiguousarray(c.index_q[:, 0])}, "index_q is 2-D"


def _r21_index_k_3d(c, pick):
    return {"index_k_cache": np.ascontiguousarray(c.index_k_cache[:, 0])}, "index_k_cache is 3-D"


def _r21_index_dims_differ(c, pick):
    ik = c.index_k_cache
    extra = np.zeros((*ik.shape[:3], pick(1, 2)), ik.dtype)
    return {"index_k_cache": np.concatenate([ik, extra], axis=3)}, "index_k_cache has a larger d_idx than index_q"


def _r21_index_heads(c, pick):
    ik = c.index_k_cache
    hk = c.problem.num_kv_heads + pick(1, 2)
    return {"index_k_cache": np.zeros((ik.shape[0], hk, *ik.shape[2:]), ik.dtype)}, \
        f"index_k_cache has Hk_idx={hk}, neither 1 nor Hkv={c.problem.num_kv_heads}"


def _r21_index_dim_zero(c, pick):
    iq, ik = c.index_q, c.index_k_cache
    return {"index_q": np.zeros((*iq.shape[:2], 0), iq.dtype),
            "index_k_cache": np.zeros((*ik.shape[:3], 0), ik.dtype)}, "d_idx = 0"


def _r23_topk(c, pick):
    bad = [0, -pick(1, 3), 2.0, True, None][pick(0, 4)]
    return {"topk": bad}, f"topk = {bad!r} (the local block needs a slot)"


def _r25_index_q_rows(c, pick):
    iq = c.index_q
    return {"index_q": np.concatenate([iq, np.zeros((1, *iq.shape[1:]), iq.dtype)])}, \
        f"index_q has Tq={iq.shape[0] + 1} rows, q has {iq.shape[0]}"


def _r25_index_q_heads(c, pick):
    iq = c.index_q
    return {"index_q": np.concatenate([iq, np.zeros((iq.shape[0], 1, iq.shape[2]), iq.dtype)], axis=1)}, \
        f"index_q has {iq.shape[1] + 1} KV heads, k_cache {iq.shape[1]}"


def _r25_index_k_pages(c, pick):
    ik = c.index_k_cache
    return {"index_k_cache": np.concatenate([ik, np.zeros((1, *ik.shape[1:]), ik.dtype)])}, \
        f"index_k_cache has {ik.shape[0] + 1} pages, k_cache {ik.shape[0]}"


def _r25_index_k_page_size(c, pick):
    ik = c.index_k_cache
    return {"index_k_cache": np.concatenate([ik, np.zeros((*ik.shape[:2], 1, ik.shape[3]), ik.dtype)], axis=2)}, \
        f"index_k_cache has page size {ik.shape[2] + 1}, k_cache {ik.shape[2]}"


INDEX_MUTATIONS: dict[str, tuple[IndexMutation, ...]] = {
    "R21": (_r21_index_q_2d, _r21_index_k_3d, _r21_index_dims_differ, _r21_index_heads, _r21_index_dim_zero),
    "R23": (_r23_topk,),
    "R25": (_r25_index_q_rows, _r25_index_q_heads, _r25_index_k_pages, _r25_index_k_page_size),
}
"""Violations of ``sparse_attention``'s index inputs: rule id -> mutations of an
:class:`~paged_sparse_attn.testing.strategies.IndexCase`."""
