"""The records a backend receives for the index branch (R21-R24).

Both are built only by the validation layer, so a backend can trust every field: index arrays
are int32 and C-contiguous, scores are float32, and the per-query quantities a kernel needs
(``query_seq``, ``query_end``, ``local_block``) are precomputed on the host. A GPU backend can
upload the arrays as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["IndexProblem", "TopkProblem"]


@dataclass(frozen=True, eq=False)
class IndexProblem:
    """A validated [`block_scores`][paged_sparse_attn.index_branch.block_scores] problem (R21, R22).

    Attributes
    ----------
    index_q : ndarray float32 [Tq, Hkv, d_idx]
        C-contiguous float32 index queries (any R7 dtype, widened exactly by the validation, R7).
    index_k_cache : ndarray or DeviceArray [P, Hk_idx, S, d_idx]
        Paged index keys, ``Hk_idx`` is 1 (shared by every KV head) or ``Hkv``.
    block_tables : ndarray int32 [B, max_pages]
    cu_seqlens_q : ndarray int32 [B + 1]
    used_kv_lens : ndarray int32 [B]
        ``L_b`` of every sequence (the default already filled in).
    query_seq : ndarray int32 [Tq]
        Sequence ``b`` of every query.
    query_end : ndarray int32 [Tq]
        Exclusive end of the positions query ``t`` may see: ``L_b``, or with ``causal``
        ``min(L_b, L_b - T_b + i + 1)``; ``<= 0`` when it sees nothing.
    block_size : int
    softmax_scale : float
        Already defaulted to ``1 / sqrt(d_idx)``.
    causal : bool
    """

    index_q: np.ndarray
    index_k_cache: Any
    block_tables: np.ndarray
    cu_seqlens_q: np.ndarray
    used_kv_lens: np.ndarray
    query_seq: np.ndarray
    query_end: np.ndarray
    block_size: int
    softmax_scale: float
    causal: bool

    @property
    def num_queries(self) -> int:
        return int(self.index_q.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.index_q.shape[1])

    @property
    def index_dim(self) -> int:
        return int(self.index_q.shape[2])

    @property
    def num_index_heads(self) -> int:
        """``Hk_idx``: 1 (one index key head shared by every KV head) or ``Hkv``."""
        return int(self.index_k_cache.shape[1])

    @property
    def num_pages(self) -> int:
        return int(self.index_k_cache.shape[0])

    @property
    def page_size(self) -> int:
        return int(self.index_k_cache.shape[2])

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_size

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def msb(self) -> int:
        return int(self.block_tables.shape[1]) // self.pages_per_block


@dataclass(frozen=True, eq=False)
class TopkProblem:
    """A validated [`select_topk`][paged_sparse_attn.index_branch.select_topk] problem (R23, R24).

    Attributes
    ----------
    scores : ndarray float32 [Tq, Hkv, msb]
        C-contiguous; NaN, ``-inf`` and ``+inf`` allowed (R24 says what they mean).
    topk : int
        Slots per row, ``>= 0`` (``>= 1`` with ``force_local``).
    local_block : ndarray int32 [Tq]
        Block forced into slot 0 of every row of query ``t``, ``-1`` for none (always ``-1``
        without ``force_local``). Every id is in ``[0, msb)``.
    force_local : bool
    """

    scores: np.ndarray
    topk: int
    local_block: np.ndarray
    force_local: bool

    @property
    def num_queries(self) -> int:
        return int(self.scores.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.scores.shape[1])

    @property
    def msb(self) -> int:
        return int(self.scores.shape[2])
