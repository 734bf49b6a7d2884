"""The property suite on the project's backends.

The tests live in the package (``paged_sparse_attn/testing/test_conformance.py``) so that any
backend can run them (``pytest --pyargs paged_sparse_attn.testing --backend NAME``); this module
collects them for the project's own run. Select backends with ``--backend`` /
``--require-backend``; see docs/testing.md.
"""

from paged_sparse_attn.testing.test_conformance import *  # noqa: F403
