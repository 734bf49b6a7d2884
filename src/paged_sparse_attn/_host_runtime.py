"""The runtime of a plan on backends without one of their own, and for the calls a backend's
runtime leaves to the plain per-call path (R32).

Each run builds the R13 index on the host and calls the backend's ``forward`` with the plan's
validated layout: the same work as ``forward``, minus the layout checks.
"""

from __future__ import annotations

import numpy as np

from ._index import build_index_arrays
from ._layout import BatchLayout
from ._types import KVOuterIndex, Problem

__all__ = ["HostRuntime"]


class HostRuntime:
    """Runs a plan's layers through ``backend.forward`` (and the index branch's methods)."""

    def __init__(self, backend, layout: BatchLayout):
        self.backend = backend
        self.layout = layout

    def _problem(self, q, k, v, sel) -> Problem:
        return Problem(q, k, v, self.layout.layout, self.layout.softmax_scale, sel, kv_layout=self.layout.kv_layout)

    def kvouter_index(self, sel: np.ndarray) -> KVOuterIndex:
        return build_index_arrays(sel, self.layout.layout)

    def run(self, q, k, v, sel):
        return self.backend.forward(self._problem(q, k, v, sel), self.kvouter_index(sel))

    def run_sparse(self, q, k, v, index_q, index_k_cache):
        from .index_branch._api import sparse_attention

        L = self.layout
        return sparse_attention(q, k, v, index_q, index_k_cache, L.block_tables, L.cu_seqlens_q,
                                used_kv_lens=L.used_kv_lens, block_size=L.block_size, topk=L.topk,
                                causal=L.causal, softmax_scale=L.softmax_scale, kv_layout=L.kv_layout,
                                backend=self.backend,
                                return_lse=True)

    def update(self, layout: BatchLayout) -> None:
        self.layout = layout

    def close(self) -> None:
        pass
