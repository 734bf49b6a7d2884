"""MSA's index branch: which blocks each query attends (R21-R25).

A cheap index query per (query, KV head) scores every block by the max of its dot products with
the block's index keys (``block_scores``); an exp-free top-k keeps the best blocks, always
including the query's own block (``select_topk``); ``sparse_attention`` chains both with
the block-sparse forward on one backend.
"""

from __future__ import annotations

from ._api import block_scores, select_topk, sparse_attention
from ._types import IndexProblem, TopkProblem
from .reference import block_scores_reference, select_topk_reference

__all__ = [
    "block_scores",
    "select_topk",
    "sparse_attention",
    "block_scores_reference",
    "select_topk_reference",
    "IndexProblem",
    "TopkProblem",
]
