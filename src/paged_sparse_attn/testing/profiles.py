"""Hypothesis profiles of the property suite: ``dev`` (default), ``ci`` and ``thorough``.

``ci`` is chosen automatically when the environment variable ``CI`` is true; any profile can be
selected with ``pytest --hypothesis-profile NAME``. Every profile prints a reproduction blob on
failure and has no deadline (the first call of a GPU backend compiles its pipelines).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PROFILE_NAMES", "CI_EXAMPLES", "register_profiles", "default_profile", "load_default_profile"]

CI_EXAMPLES = 20
"""Examples per property and backend in the ``ci`` profile."""

_PROFILES = {
    # derandomized and without an example database: the same examples on every CI run; no
    # "explain" phase (it reruns a failure many times to annotate lines)
    "ci": dict(max_examples=CI_EXAMPLES, derandomize=True, database=None,
               phases=("explicit", "reuse", "generate", "target", "shrink")),
    "dev": dict(max_examples=60),
    "thorough": dict(max_examples=1000),
}

PROFILE_NAMES = tuple(_PROFILES)


def register_profiles() -> None:
    """Register (or refine) the profiles ``ci``, ``dev`` and ``thorough``.

    Hypothesis ships a ``ci`` profile of its own (derandomized, no database, 100 examples); ours
    keeps its settings and bounds the number of examples so the suite fits the CI budget.
    """
    from hypothesis import HealthCheck, Phase, settings

    common: dict[str, Any] = dict(
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    for name, opts in _PROFILES.items():
        try:
            parent = settings.get_profile(name)
        except Exception:
            parent = None
        opts = dict(opts)
        if "phases" in opts:
            opts["phases"] = [Phase[p] for p in opts["phases"]]
        settings.register_profile(name, parent, **common, **opts)


def default_profile() -> str:
    """``"ci"`` when the environment variable ``CI`` is true, else ``"dev"``."""
    return "ci" if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on") else "dev"


def load_default_profile(config: Any) -> str | None:
    """Load ``default_profile`` unless ``--hypothesis-profile`` chose one; returns the loaded name."""
    try:
        from hypothesis import settings
    except ImportError:
        return None
    if config.getoption("hypothesis_profile", None):
        return None  # hypothesis' own plugin has loaded the requested profile
    register_profiles()
    name = default_profile()
    settings.load_profile(name)
    return name
