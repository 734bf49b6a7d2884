"""Loaded when pytest collects the packaged suite (``pytest --pyargs paged_sparse_attn.testing``).

Loads the default hypothesis profile (``ci`` when ``CI`` is true, else ``dev``) unless
``--hypothesis-profile`` chose one. The options and the ``backend`` fixture come from the plugin
``paged_sparse_attn.testing.pytest_plugin``.
"""

from paged_sparse_attn.testing.profiles import load_default_profile


def pytest_configure(config):
    load_default_profile(config)
