"""The backend registry: built-in backends, entry-point plugins and runtime registrations.

The backends known to the registry come from a small pipeline, run on the first registry call
and again by ``refresh_backends``:

1. **discover** the entry points of the group ``paged_sparse_attn.backends``;
2. **de-duplicate**: a plugin named like a built-in backend is dropped (the built-in wins), and
   of several plugins of one name the first is kept; each drop is a ``RuntimeWarning``;
3. **sort**: the built-ins in their fixed order, then the plugins by name; runtime
   registrations (``register_backend``) follow, in the order they were made.

Backends are imported lazily: ``import paged_sparse_attn`` imports no optional dependency. A
backend that fails to import gives a ``RuntimeWarning`` once, and ``list_backends`` reports
it as unavailable with the reason. Availability is probed, never assumed (R18): the factory's
``probe()`` when it has one, else the ``probe()`` of the backend it builds. A probe never raises.
There is never a silent fallback to another backend (R18).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ._types import Availability, DeviceArray
from .backends.base import Backend
from .errors import BackendUnavailableError

__all__ = [
    "ENTRY_POINT_GROUP",
    "DEFAULT_BACKEND",
    "register_backend",
    "unregister_backend",
    "list_backends",
    "get_backend",
    "resolve_backend",
    "use_backend",
    "refresh_backends",
    "registry_scope",
    "registry_name",
    "load_factory",
]

ENTRY_POINT_GROUP = "paged_sparse_attn.backends"
DEFAULT_BACKEND = "numpy"

BUILTIN_BACKENDS: dict[str, str] = {
    "numpy": "paged_sparse_attn.backends.numpy_backend:NumpyBackend",
    "wgpu": "paged_sparse_attn.backends.wgpu:WgpuBackend",
    "dawn": "paged_sparse_attn.backends.wgpu:DawnBackend",
}
"""Registry name -> ``"module:attr"`` of the built-in backends, in listing order."""


@dataclass
class _Entry:
    """One registered backend: where it comes from and, once imported, its factory."""

    name: str
    target: Any  # "module:attr" (imported lazily) or a factory callable
    origin: str  # "builtin", "plugin" or "runtime"
    factory: Callable[..., Backend] | None = None
    error: str | None = None  # why it could not be imported (read by every probe)


class _State:
    """Everything the registry holds; one instance, swapped by :func:`registry_scope`."""

    def __init__(self, builtins: dict[str, str]):
        self.builtins = {n: _Entry(n, t, "builtin") for n, t in builtins.items()}
        self.plugins: dict[str, _Entry] | None = None  # None: entry points not read yet
        self.runtime: dict[str, _Entry] = {}
        self.instances: dict[str, Backend] = {}
        self.borrowed: frozenset[int] = frozenset()  # ids of instances an outer scope owns

    def entries(self) -> dict[str, _Entry]:
        """Every backend, in listing order; a runtime registration replaces one of its name."""
        if self.plugins is None:
            self.plugins = _build_plugins(self.builtins)
        found = {n: self.runtime.get(n, e) for n, e in self.builtins.items()}  # keep the position
        for n, e in self.plugins.items():
            found[n] = self.runtime.get(n, e)
        for n, e in self.runtime.items():
            found.setdefault(n, e)
        return found


_lock = threading.RLock()
_state = _State(BUILTIN_BACKENDS)
_current: contextvars.ContextVar[str | Backend | None] = contextvars.ContextVar(
    "paged_sparse_attn_backend", default=None
)


# --- the plugin pipeline: discover -> de-duplicate -> sort ------------------------------------

def _discover(group: str) -> list[Any]:
    """The entry points of ``group``; an unreadable environment gives a warning and none."""
    try:
        from importlib.metadata import entry_points

        return list(entry_points(group=group))
    except Exception as exc:  # a broken environment must not break the package
        warnings.warn(f"paged_sparse_attn: could not read the entry points of {group!r}: {exc!r}",
                      RuntimeWarning, stacklevel=3)
        return []


def _deduplicate(eps: Iterable[Any], reserved: Iterable[str]) -> dict[str, Any]:
    """One entry point per name; names in ``reserved`` (the built-ins) are never taken by a plugin."""
    reserved = set(reserved)
    kept: dict[str, Any] = {}
    for ep in eps:
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an unknown distribution"
        if ep.name in reserved:
            warnings.warn(f"paged_sparse_attn: the plugin backend {ep.name!r} ({ep.value}, from {dist}) is "
                          f"ignored: a built-in backend has that name", RuntimeWarning, stacklevel=3)
        elif ep.name in kept:
            warnings.warn(f"paged_sparse_attn: several plugins declare the backend {ep.name!r}; "
                          f"{kept[ep.name].value} is used, {ep.value} (from {dist}) is ignored",
                          RuntimeWarning, stacklevel=3)
        else:
            kept[ep.name] = ep
    return kept


def _sort(eps: dict[str, Any]) -> dict[str, _Entry]:
    """Plugins by name, as lazily imported entries."""
    return {n: _Entry(n, eps[n].value, "plugin") for n in sorted(eps)}


def _build_plugins(builtins: Iterable[str]) -> dict[str, _Entry]:
    return _sort(_deduplicate(_discover(ENTRY_POINT_GROUP), builtins))


# --- loading and probing ----------------------------------------------------------------------

def load_factory(spec: str) -> Callable[..., Backend]:
    """Import ``"module:attr"`` and return the attribute (a Backend class or factory)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise BackendUnavailableError(f"backend spec {spec!r} is not of the form 'module:factory' [R18]")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _label(name: str, factory: Any = None) -> str:
    """A backend in a registry message: its own ``name`` when known, and the registry name."""
    own = getattr(factory, "name", None)
    return f"{own!r} (registered as {name!r})" if isinstance(own, str) and own != name else f"{name!r}"


def _entry(name: str) -> _Entry:
    entry = _state.entries().get(name)
    if entry is None:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; registered: {', '.join(_state.entries())} [R18]")
    return entry


def _factory(entry: _Entry) -> Callable[..., Backend]:
    """The entry's factory, imported once; an import failure is kept and warned about once."""
    if entry.factory is not None:
        return entry.factory
    if entry.error is None:
        if not isinstance(entry.target, str):
            entry.factory = entry.target
            return entry.factory
        try:
            entry.factory = load_factory(entry.target)
            return entry.factory
        except Exception as exc:
            entry.error = f"could not be imported ({type(exc).__name__}: {exc})"
            if entry.origin != "runtime":  # a registration made in code gets the error, not a warning
                warnings.warn(f"paged_sparse_attn: backend {entry.name!r} ({entry.target}) {entry.error}",
                              RuntimeWarning, stacklevel=4)
    raise BackendUnavailableError(f"backend {entry.name!r} {entry.error.removesuffix(' [R18]')} [R18]")


def _build(name: str) -> Backend:
    factory = _factory(_entry(name))
    inst = factory()
    if not isinstance(inst, Backend):
        raise BackendUnavailableError(
            f"backend {_label(name, factory)}: factory returned {type(inst).__name__}, not a Backend [R18]")
    return inst


def _instantiate(name: str) -> Backend:
    """The cached instance; only a backend whose probe said yes is ever cached."""
    inst = _state.instances.get(name)
    if inst is None:
        inst = _state.instances[name] = _build(name)
    return inst


def _as_availability(avail: Any) -> Availability:
    if isinstance(avail, Availability):
        return avail
    return Availability(bool(avail), "ok" if avail else "probe returned a false value")


def _probe(name: str) -> Availability:
    """The backend's availability: the factory's probe, else the probe of the backend it builds."""
    try:
        factory = _factory(_entry(name))
    except BackendUnavailableError as exc:
        return Availability(False, str(exc))
    try:
        probe = getattr(factory, "probe", None)
        if callable(probe):
            return _as_availability(probe())
        # a plain factory function: build the backend and ask it (availability is never assumed)
        inst = _state.instances.get(name) or _build(name)
        avail = _as_availability(inst.probe())
        if avail.ok:
            _state.instances.setdefault(name, inst)
        elif _state.instances.get(name) is not inst:
            inst.close()
        return avail
    except Exception as exc:  # a probe never raises
        return Availability(False, f"probe failed: {type(exc).__name__}: {exc}")


# --- public API -------------------------------------------------------------------------------

def register_backend(name: str, factory: Callable[..., Backend] | str, *, replace: bool = False) -> None:
    """Register a backend under ``name``.

    Parameters
    ----------
    name : str
        Registry name, used as ``forward(..., backend=name)``.
    factory : callable or str
        A Backend subclass, a zero-argument callable returning a Backend, or ``"module:attr"``.
        Its ``probe()`` (when it has one, else the probe of the backend it returns) decides
        whether ``list_backends`` reports it available and ``get_backend`` uses it.
    replace : bool
        Allow replacing an existing registration (built-ins and plugins included).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend(): name must be a non-empty str, got {name!r}")
    with _lock:
        if not replace and name in _state.entries():
            raise ValueError(f"register_backend(): backend {name!r} is already registered (pass replace=True)")
        _state.runtime[name] = _Entry(name, factory, "runtime")
        inst = _state.instances.pop(name, None)
    if inst is not None:
        inst.close()


def unregister_backend(name: str) -> None:
    """Remove a runtime registration (and its cached instance). Built-ins and plugins stay."""
    with _lock:
        if name not in _state.runtime and name in _state.entries():
            raise ValueError(f"unregister_backend(): {name!r} is a built-in or plugin backend")
        _state.runtime.pop(name, None)
        inst = _state.instances.pop(name, None)
    if inst is not None:
        inst.close()


def refresh_backends() -> None:
    """Read the entry points again and forget import failures and cached instances.

    Call it after installing or fixing a plugin in a running process. Runtime registrations are
    kept; the cached backend instances are closed (the next call builds new ones).
    """
    with _lock:
        insts = [i for i in _state.instances.values() if id(i) not in _state.borrowed]
        _state.instances.clear()
        _state.plugins = None
        for e in [*_state.builtins.values(), *_state.runtime.values()]:
            e.factory = e.error = None
    for inst in insts:
        inst.close()


@contextlib.contextmanager
def registry_scope(*, builtins: Iterable[str] | None = None) -> Iterator[None]:
    """Undo, on exit, every registration, removal and refresh made inside (tests, notebooks).

    Parameters
    ----------
    builtins : iterable of str, optional
        Keep only these built-in backends inside the scope (e.g. ``("numpy",)`` to keep a
        discovery loop away from a GPU).

    Notes
    -----
    The scope swaps the whole registry, so it is meant for one thread at a time. Backends built
    inside the scope are closed on exit; those built before are kept.
    """
    global _state
    with _lock:
        outer = _state
        inner = copy.copy(outer)
        inner.builtins = {n: copy.copy(e) for n, e in outer.builtins.items()
                          if builtins is None or n in set(builtins)}
        inner.runtime = {n: copy.copy(e) for n, e in outer.runtime.items()}
        inner.plugins = None if outer.plugins is None else {n: copy.copy(e) for n, e in outer.plugins.items()}
        inner.instances = dict(outer.instances)
        inner.borrowed = frozenset(id(i) for i in outer.instances.values()) | outer.borrowed
        _state = inner
    try:
        yield
    finally:
        with _lock:
            _state = outer
            new = [i for i in inner.instances.values() if id(i) not in inner.borrowed]
        for inst in new:
            inst.close()


def registry_name(backend: Any) -> str | None:
    """The registry name of a backend instance built by the registry, None for any other."""
    with _lock:
        return next((n for n, i in _state.instances.items() if i is backend), None)


def list_backends() -> dict[str, Availability]:
    """Every registered backend (built-in, plugin, runtime) with its availability. Never raises.

    Returns
    -------
    dict of str to Availability
        In listing order: built-ins, plugins by name, runtime registrations.
    """
    with _lock:
        return {name: _probe(name) for name in _state.entries()}


def get_backend(name: str | Backend | None = None) -> Backend:
    """Return the (shared, cached) backend instance for ``name``.

    Parameters
    ----------
    name : str, Backend or None
        A registered name, ``"module:factory"``, a Backend instance (returned as is), or None for
        the current default (see [`use_backend`][paged_sparse_attn.use_backend]; ``"numpy"``
        unless changed).

    Raises
    ------
    BackendUnavailableError
        If the backend is unknown or its probe says it cannot run here; the message says why
        and how to fix it.
    """
    if isinstance(name, Backend):
        return name
    if name is None:
        cur = _current.get()
        if isinstance(cur, Backend):
            return cur
        name = cur or DEFAULT_BACKEND
    if not isinstance(name, str):
        raise BackendUnavailableError(f"backend must be a name, a Backend or None, got {type(name).__name__} [R18]")
    with _lock:
        inst = _state.instances.get(name)
        if inst is not None:  # cached only after its probe said yes
            return inst
        adhoc = name not in _state.entries() and ":" in name
        if adhoc:  # "module:factory": registered only once it is known to work
            _state.runtime[name] = _Entry(name, name, "runtime")
        try:
            avail = _probe(name)
            if not avail.ok:
                reason = avail.reason.removesuffix(" [R18]")
                label = _label(name, _state.entries()[name].factory) if name in _state.entries() else repr(name)
                raise BackendUnavailableError(f"backend {label} is unavailable: {reason} [R18]")
            try:
                return _instantiate(name)
            except BackendUnavailableError:
                raise
            except Exception as exc:
                raise BackendUnavailableError(
                    f"backend {_label(name, _state.entries()[name].factory)} failed to start: "
                    f"{type(exc).__name__}: {exc} [R18]") from exc
        except BackendUnavailableError:
            if adhoc:
                _state.runtime.pop(name, None)
            raise


def resolve_backend(backend: str | Backend | None, *arrays: Any) -> Backend:
    """Backend for a call: explicit choice, else the owner of device-resident inputs, else default."""
    if backend is None:
        for a in arrays:
            if isinstance(a, DeviceArray):
                return a.backend
    return get_backend(backend)


@contextlib.contextmanager
def use_backend(backend: str | Backend) -> Iterator[Backend]:
    """Context manager that sets the default backend of ``forward()`` & co. in this context.

    Examples
    --------
    >>> import paged_sparse_attn as psa
    >>> with psa.use_backend("numpy") as be:
    ...     be.name
    'numpy'
    """
    inst = get_backend(backend)  # fail early, with the reason, if it cannot run
    token = _current.set(inst)
    try:
        yield inst
    finally:
        _current.reset(token)
