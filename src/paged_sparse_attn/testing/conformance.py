"""The conformance kit: run the packaged property suite against one backend.

From a shell::

    pytest --pyargs paged_sparse_attn.testing --backend mypkg.backend:MyBackend

From Python (the ``paged-sparse-attn check`` command calls this)::

    from paged_sparse_attn.testing import run_conformance
    exit_code = run_conformance("mypkg.backend:MyBackend")
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["run_conformance", "pytest_args", "plugin_args", "SUITE"]

SUITE = "paged_sparse_attn.testing"
"""The package whose ``test_*.py`` modules are the property suite (``pytest --pyargs``)."""

PLUGIN = "paged_sparse_attn.testing.pytest_plugin"


def _plugin_autoloaded() -> bool:
    """Will pytest load the plugin by itself (installed ``pytest11`` entry point, autoload on)?"""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    try:
        from importlib.metadata import entry_points

        return any(ep.value == PLUGIN for ep in entry_points(group="pytest11"))
    except Exception:
        return False


def plugin_args() -> list[str]:
    """``-p`` arguments that load the suite's plugins when pytest will not autoload them."""
    if _plugin_autoloaded():
        return []
    args = ["-p", PLUGIN]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", "_hypothesis_pytestplugin"]  # for --hypothesis-profile
    return args


def pytest_args(backend_spec: str, profile: str | None = "ci", extra_args: Sequence[str] = ()) -> list[str]:
    """The pytest command-line arguments of ``run_conformance``."""
    args = ["--pyargs", SUITE, "--backend", backend_spec, "--require-backend", backend_spec,
            "-p", "no:cacheprovider", *plugin_args()]
    if profile:
        args += ["--hypothesis-profile", profile]
    return [*args, *extra_args]


def run_conformance(backend_spec: str, profile: str = "ci", *, extra_args: Sequence[str] = ()) -> int:
    """Run the property suite against one backend; return pytest's exit code (0 = conforms).

    Parameters
    ----------
    backend_spec : str
        A registered backend name (built-in or from the ``paged_sparse_attn.backends`` entry
        point group) or ``"module:factory"``. The backend is *required*: if it is unavailable
        the run fails.
    profile : str
        Hypothesis profile: ``"ci"`` (derandomized, bounded), ``"dev"`` or ``"thorough"``.
    extra_args : sequence of str
        More pytest arguments, e.g. ``["-x", "-k", "R16"]``.

    Returns
    -------
    int
        pytest's exit code: 0 all passed, 1 some test failed, 2-5 usage/collection problems.
    """
    import pytest

    return int(pytest.main(pytest_args(backend_spec, profile, extra_args)))
