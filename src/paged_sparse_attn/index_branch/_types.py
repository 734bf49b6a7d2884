"""The index branch's validated problems; defined with the other data records in
``paged_sparse_attn._types`` (backends import them from there) and re-exported here."""

from __future__ import annotations

from .._types import IndexProblem, TopkProblem

__all__ = ["IndexProblem", "TopkProblem"]
