"""Page tables in the CSR form of FlashInfer (``paged_kv_indptr`` / ``paged_kv_indices`` /
``paged_kv_last_page_len``) as this package's ``block_tables`` and ``used_kv_lens`` (R2, R4).

Pure numpy: no device, no backend. Validated like every public input (R17): an error names the
argument, what was expected, what was got, and the rule of the array it would become.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._validation import _fail, check_block_size, check_int_array, check_page_size

__all__ = ["block_tables_from_indptr"]


def block_tables_from_indptr(paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any, *,
                             page_size: Any, block_size: Any) -> tuple[np.ndarray, np.ndarray]:
    """``block_tables`` and ``used_kv_lens`` of a page table in FlashInfer's CSR form.

    Sequence ``b`` owns pages ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b + 1]]``, in
    logical order; its last page holds ``paged_kv_last_page_len[b]`` positions.

    Parameters
    ----------
    paged_kv_indptr : int array [B + 1]
        0, then non-decreasing: the page offsets of the sequences.
    paged_kv_indices : int array [>= paged_kv_indptr[-1]]
        Physical page ids, ``>= 0``.
    paged_kv_last_page_len : int array [B]
        Positions on the last page, in ``[1, page_size]`` for a sequence with pages; 0 for a
        sequence without any.
    page_size, block_size : int
        ``S`` and the sparse block size (a positive multiple of ``S``, R5).

    Returns
    -------
    block_tables : ndarray int32 [B, max_pages]
        Row b holds the sequence's pages, then ``-1`` (unmapped, R2) up to ``max_pages``: the
        longest sequence's page count rounded up to whole blocks (at least one block), so that
        every position lies in a block (R4, R5).
    used_kv_lens : ndarray int32 [B]
        ``(n_b - 1) * page_size + paged_kv_last_page_len[b]`` for ``n_b >= 1`` pages, else 0.

    Raises
    ------
    SpecError
        A malformed table: the message names the argument and the rule (R2 for the pages, R4
        for the lengths, R5 for the sizes).
    """
    fn = "block_tables_from_indptr"
    S = check_page_size(page_size, fn)
    bs = check_block_size(block_size, S, fn)
    ptr = check_int_array(paged_kv_indptr, fn, "paged_kv_indptr", 1, "R2").astype(np.int64)
    idx = check_int_array(paged_kv_indices, fn, "paged_kv_indices", 1, "R2").astype(np.int64)
    last = check_int_array(paged_kv_last_page_len, fn, "paged_kv_last_page_len", 1, "R4").astype(np.int64)
    if ptr.shape[0] < 1 or ptr[0] != 0:
        got = "an empty array" if ptr.shape[0] < 1 else int(ptr[0])
        raise _fail(fn, f"paged_kv_indptr must start at 0 (B + 1 entries), got {got}", "R2")
    n = np.diff(ptr)
    if (n < 0).any():
        j = int(np.argmax(n < 0))
        raise _fail(fn, f"paged_kv_indptr must be non-decreasing, got {int(ptr[j])} then {int(ptr[j + 1])} at "
                    f"[{j}, {j + 1}]", "R2")
    if int(ptr[-1]) > idx.shape[0]:
        raise _fail(fn, f"paged_kv_indices must hold paged_kv_indptr[-1]={int(ptr[-1])} page ids, got "
                    f"{idx.shape[0]}", "R2")
    if idx.size and int(idx.min()) < 0:
        raise _fail(fn, f"paged_kv_indices must be page ids >= 0, got {int(idx.min())}", "R2")
    B = ptr.shape[0] - 1
    if last.shape[0] != B:
        raise _fail(fn, f"paged_kv_last_page_len must have B={B} entries (paged_kv_indptr has B + 1), got "
                    f"{last.shape[0]}", "R4")
    bad = np.where(n > 0, (last < 1) | (last > S), last != 0)
    if bad.any():
        j = int(np.argmax(bad))
        want = f"in [1, page_size={S}]" if n[j] > 0 else "0 (the sequence has no page)"
        raise _fail(fn, f"paged_kv_last_page_len[{j}] must be {want}, got {int(last[j])}", "R4")
    ppb = bs // S
    max_pages = max(1, -(-int(n.max(initial=0)) // ppb)) * ppb
    bt = np.full((B, max_pages), -1, dtype=np.int64)
    col = np.arange(max_pages)
    has = col[None, :] < n[:, None]  # [B, max_pages]: the sequence's own pages, in order
    bt[has] = idx[(ptr[:-1, None] + col[None, :])[has]]
    lens = np.where(n > 0, (n - 1) * S + last, 0)
    return check_int_array(bt, fn, "paged_kv_indices", 2, "R2"), check_int_array(lens, fn, "used_kv_lens", 1, "R4")
