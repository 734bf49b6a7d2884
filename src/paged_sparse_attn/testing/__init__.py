"""Testing tools: strategies, dtype-derived assertions and the backend conformance kit.

* ``paged_sparse_attn.testing.strategies`` -- hypothesis strategies of valid and invalid
  problems (needs the ``test`` extra; imported only when you import it).
* ``paged_sparse_attn.testing.assertions`` -- ``assert_attention_close`` and
  ``tolerance`` / ``problem_tolerance``, the tolerances of R20.
* ``paged_sparse_attn.testing.oracle`` -- the rules as small independent numpy formulas.
* ``paged_sparse_attn.testing.generate`` -- seeded generators of paged problems (scrambled pages,
  holes, selections with the local block, NaN/Inf poison, the benchmarks' MSA geometry): the one
  source of problems of the tests, the demo and the benchmarks.
* ``run_conformance`` -- run the packaged property suite
  (``paged_sparse_attn/testing/test_conformance.py``) against a backend.

Importing this package imports neither hypothesis nor pytest.
"""

from __future__ import annotations

from .assertions import Tolerance, assert_attention_close, assert_partials_close, problem_tolerance, tolerance
from .conformance import run_conformance
from .problem import AttentionProblem, InvalidCall

__all__ = [
    "AttentionProblem",
    "InvalidCall",
    "Tolerance",
    "tolerance",
    "problem_tolerance",
    "assert_attention_close",
    "assert_partials_close",
    "run_conformance",
]
