"""Project-wide pytest configuration.

The options ``--backend NAME`` / ``--require-backend NAME``, the session-scoped ``backend``
fixture and the report header come from the plugin ``paged_sparse_attn.testing.pytest_plugin``
(installed as a ``pytest11`` entry point; loaded here when the package is not installed). The
hypothesis profile is ``ci`` when the environment variable ``CI`` is true, else ``dev``;
``--hypothesis-profile thorough`` runs many more examples.
"""

import sys

import pytest

from paged_sparse_attn.testing.profiles import load_default_profile, register_profiles

_PLUGIN = "paged_sparse_attn.testing.pytest_plugin"

# The entry point has already imported the plugin when the package is installed; registering it
# a second time under another name would be an error.
pytest_plugins = [] if _PLUGIN in sys.modules else [_PLUGIN]

# At import, before hypothesis' plugin loads a profile named by --hypothesis-profile.
try:
    register_profiles()
except ImportError:  # hypothesis (the ``test`` extra) is missing: the property tests will say so
    pass


def pytest_configure(config):
    from paged_sparse_attn.testing import pytest_plugin

    pytest_plugin.activate(config)
    load_default_profile(config)



@pytest.fixture(scope="session")
def WgpuBackend():
    """The wgpu backend class; the tests that use it require it to be available (no skip)."""
    from paged_sparse_attn.backends.wgpu import WgpuBackend

    avail = WgpuBackend.probe()
    assert avail.ok, f"the wgpu backend must be available for these tests: {avail.reason}"
    return WgpuBackend


@pytest.fixture
def dawn_runtime():
    """The Dawn runtime record, for tests that need ``wgpudawn`` but no GPU (its Null adapter).

    Skipped where ``wgpudawn`` is missing, except in continuous integration (``CI`` set), which
    installs it and must run these tests.
    """
    import os

    from paged_sparse_attn.backends.wgpu._runtime import DAWN

    if not DAWN.installed():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the Dawn checks: {DAWN.install_hint}")
        pytest.skip(DAWN.install_hint)
    return DAWN


@pytest.fixture
def tint_device(dawn_runtime):
    """``(device, ctx)``: a device of Dawn's Null adapter (Tint validates shaders and pipelines,
    nothing runs) and the context ``kernel_source`` needs; the device is destroyed afterwards."""
    from paged_sparse_attn.backends.wgpu._shader_check import null_context, null_device

    device = null_device()
    try:
        yield device, null_context()
    finally:
        device.destroy()
