"""paged_sparse_attn: block-sparse attention over a paged KV cache, computed KV-outer.

The numpy backend is the executable spec; optional backends (``wgpu``) are imported lazily:
``import paged_sparse_attn`` imports numpy and nothing else heavy.
"""

from __future__ import annotations

from ._api import build_kvouter_index, combine_partials, forward, forward_partials
from ._attention_plan import AttentionPlan, plan_attention
from ._layout import BatchLayout
from ._paged_kv import block_tables_from_indptr
from ._types import AttentionInputs, Availability, Capabilities, DeviceArray, KVOuterIndex, Partials, Problem, SeqLayout
from .backends.base import Backend
from .errors import (
    BackendUnavailableError,
    DeviceError,
    PagedSparseAttnError,
    SpecError,
    UnsupportedError,
)
from .reference import dense_reference, lse_from_base2, lse_to_base2, merge_states
from .registry import (get_backend, list_backends, refresh_backends, register_backend, unregister_backend,
                       use_backend)
from .index_branch import block_scores, select_topk, sparse_attention

__version__ = "0.1.0"

__all__ = [
    "forward",
    "plan_attention",
    "AttentionPlan",
    "BatchLayout",
    "forward_partials",
    "combine_partials",
    "build_kvouter_index",
    "dense_reference",
    "block_scores",
    "select_topk",
    "sparse_attention",
    "merge_states",
    "lse_to_base2",
    "lse_from_base2",
    "block_tables_from_indptr",
    "list_backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
    "use_backend",
    "refresh_backends",
    "Backend",
    "Availability",
    "Capabilities",
    "DeviceArray",
    "KVOuterIndex",
    "Partials",
    "Problem",
    "AttentionInputs",
    "SeqLayout",
    "PagedSparseAttnError",
    "SpecError",
    "UnsupportedError",
    "BackendUnavailableError",
    "DeviceError",
    "__version__",
]
