"""The page-layout properties (R34) of the conformance kit, on the project's backends."""

from paged_sparse_attn.testing.test_kv_layout import *  # noqa: F403
