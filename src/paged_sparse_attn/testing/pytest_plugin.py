"""The pytest plugin of the property suite (entry point ``pytest11``: ``paged_sparse_attn``).

It adds

* ``--backend NAME`` (repeatable): run the backend-parametrized tests on these backends only;
  ``NAME`` is a registry name or ``module:factory``. Default: every registered backend.
* ``--require-backend NAME`` (repeatable): the backend must be available; if it is not, every
  test on it fails (an error, never a skip) and the session exits non-zero. Required backends are
  selected too.
* the session-scoped ``backend`` fixture, parametrized over the selected backends; a backend
  that is unavailable and not required is skipped with the reason.
* a report header line per backend with its availability.
* the marker ``psa_backends(exclude=(...))`` that leaves some backends out of a test.

The options are registered by the plugin, so they are known before pytest parses the command
line whatever the rootdir and the test paths are. Hypothesis is imported only when the suite's
profiles are asked for (``--hypothesis-profile ci|dev|thorough``) or by the suite's conftests.
"""

from __future__ import annotations

from typing import Any

import pytest

from .profiles import PROFILE_NAMES, register_profiles

__all__ = ["selected_backends", "availability", "activate"]

_AVAIL = pytest.StashKey[dict]()
_ACTIVE = pytest.StashKey[bool]()
_FAILED_REQUIRED = pytest.StashKey[dict]()

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("paged_sparse_attn", "paged_sparse_attn backends")
    group.addoption(
        "--backend", action="append", default=[], dest="psa_backends", metavar="NAME",
        help="run the backend tests on NAME (a registered name or module:factory); repeatable. "
             "Default: every registered backend.")
    group.addoption(
        "--require-backend", action="append", default=[], dest="psa_required", metavar="NAME",
        help="fail (not skip) if backend NAME is unavailable; repeatable. Implies --backend NAME.")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # our profiles must exist before hypothesis' own plugin loads --hypothesis-profile; only in
    # sessions that run the suite (other projects may have profiles of the same names)
    if config.getoption("hypothesis_profile", None) in PROFILE_NAMES and _show_header(config):
        try:
            register_profiles()
        except ImportError:
            pass
    config.addinivalue_line(
        "markers", "psa_backends(exclude=()): leave the named backends out of this test's `backend` parameters")
    config.stash[_FAILED_REQUIRED] = {}
    for spec in [*config.getoption("psa_backends", []), *config.getoption("psa_required", [])]:
        _register_spec(spec)


def activate(config: pytest.Config) -> None:
    """Show the backend report header even without ``--backend`` (called by the project's conftest)."""
    config.stash[_ACTIVE] = True


def _register_spec(spec: str) -> None:
    """Make ``module:factory`` specs known to the registry (lazily: importing happens on probe)."""
    import paged_sparse_attn as psa

    if ":" in spec:
        try:
            psa.register_backend(spec, spec)
        except ValueError:
            pass  # already registered


def availability(config: pytest.Config) -> dict[str, Any]:
    """``psa.list_backends()``, probed once per session."""
    if _AVAIL not in config.stash:
        import paged_sparse_attn as psa

        config.stash[_AVAIL] = psa.list_backends()
    return config.stash[_AVAIL]


def _required(config: pytest.Config) -> list[str]:
    return list(dict.fromkeys(config.getoption("psa_required", [])))


def selected_backends(config: pytest.Config) -> list[str]:
    """The backends the ``backend`` fixture runs on: ``--backend`` (or all registered) plus required ones."""
    chosen = list(config.getoption("psa_backends", [])) or list(availability(config))
    return list(dict.fromkeys([*chosen, *_required(config)]))


def _ours(metafunc: pytest.Metafunc) -> bool:
    """Is the ``backend`` fixture of this test the one defined here (not a project's own)?"""
    defs = getattr(metafunc, "_arg2fixturedefs", {}).get("backend")
    if not defs:
        return False
    func = getattr(defs[-1], "func", None)
    return getattr(func, "__module__", None) == __name__


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames or not _ours(metafunc):
        return
    names = selected_backends(metafunc.config)
    for mark in metafunc.definition.iter_markers("psa_backends"):
        excluded = set(mark.kwargs.get("exclude", ()))
        names = [n for n in names if n not in excluded]
    metafunc.parametrize("backend", names, indirect=True, ids=names, scope="session")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest):
    """A backend instance (session-scoped: safe inside ``@given``); parametrized by the plugin."""
    import paged_sparse_attn as psa

    name = request.param
    avail = availability(request.config).get(name)
    reason = avail.reason if avail is not None else f"backend {name!r} is not registered"
    be = None
    if avail is not None and avail.ok:
        try:
            be = psa.get_backend(name)
        except Exception as exc:  # a probe said yes but it does not start: same treatment
            reason = f"{type(exc).__name__}: {exc}"
    if be is None:
        if name in _required(request.config):
            request.config.stash[_FAILED_REQUIRED][name] = reason
            pytest.fail(f"backend {name!r} is required (--require-backend) but unavailable: {reason}",
                        pytrace=False)
        pytest.skip(f"backend {name!r} is unavailable: {reason}")
    return be


def _show_header(config: pytest.Config) -> bool:
    if config.stash.get(_ACTIVE, False):
        return True
    if config.getoption("psa_backends", []) or config.getoption("psa_required", []):
        return True
    return any("paged_sparse_attn" in str(a) for a in config.args)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not _show_header(config):
        return None
    chosen = set(selected_backends(config))
    required = set(_required(config))
    lines = ["paged_sparse_attn backends:"]
    for name, av in availability(config).items():
        tags = [t for t, on in (("selected", name in chosen), ("required", name in required)) if on]
        state = "available" if av.ok else ("UNAVAILABLE (required)" if name in required else "unavailable")
        lines.append(f"  {name}: {state}{' [' + ', '.join(tags) + ']' if tags else ''} - {av.reason}")
    for name in sorted(chosen - set(availability(config))):
        lines.append(f"  {name}: not registered{' (required)' if name in required else ''}")
    return lines


def _unavailable_required(config: pytest.Config) -> dict[str, str]:
    out = dict(config.stash.get(_FAILED_REQUIRED, {}))
    avail = availability(config) if _required(config) else {}
    for name in _required(config):
        av = avail.get(name)
        if av is None or not av.ok:
            out.setdefault(name, av.reason if av is not None else "not registered")
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # a required backend that is unavailable fails the run even if no selected test used it
    if _unavailable_required(session.config) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    missing = _unavailable_required(config)
    for name, reason in missing.items():
        terminalreporter.write_line(f"ERROR: required backend {name!r} is unavailable: {reason}", red=True)
