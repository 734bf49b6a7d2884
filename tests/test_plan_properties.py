"""The plan and device-array properties (R30-R33, R35, R36) of the conformance kit, on the project's backends."""

from paged_sparse_attn.testing.test_plans import *  # noqa: F403
