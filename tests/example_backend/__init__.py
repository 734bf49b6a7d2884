"""A tiny third-party backend used by the docs and by the tests of the conformance kit."""
