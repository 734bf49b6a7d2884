"""The backend registry: built-in backends, entry-point plugins and runtime registrations.

Backends are imported lazily: ``import paged_sparse_attn`` imports no optional dependency, and
a probe never raises (it returns an ``Availability`` with a reason a person can act on). There is never a silent fallback to another backend (R18).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from typing import Any, Callable, Iterator

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
    "load_factory",
]

ENTRY_POINT_GROUP = "paged_sparse_attn.backends"
DEFAULT_BACKEND = "numpy"

# name -> "module:attr" (lazy) or a factory callable
_BUILTIN: dict[str, str] = {
    "numpy": "paged_sparse_attn.backends.numpy_backend:NumpyBackend",
    "wgpu": "paged_sparse_attn.backends.wgpu:WgpuBackend",
}
_registered: dict[str, Any] = {}
_instances: dict[str, Backend] = {}
_broken: dict[str, str] = {}  # plugin name -> why it could not be loaded
_lock = threading.RLock()
_plugins_loaded = False
_current: contextvars.ContextVar[str | Backend | None] = contextvars.ContextVar(
    "paged_sparse_attn_backend", default=None
)


def load_factory(spec: str) -> Callable[..., Backend]:
    """Import ``"module:attr"`` and return the attribute (a Backend class or factory)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise BackendUnavailableError(f"backend spec {spec!r} is not of the form 'module:factory'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _load_plugins() -> None:
    """Register entry points of group ``paged_sparse_attn.backends`` once; never raises."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    try:
        from importlib.metadata import entry_points

        eps = entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # a broken environment must not break import
        _broken["<entry points>"] = f"could not read entry points: {exc!r}"
        return
    for ep in eps:
        if ep.name in _BUILTIN or ep.name in _registered:
            continue
        _registered[ep.name] = ep.value  # imported lazily, like the built-ins


def register_backend(name: str, factory: Callable[..., Backend] | str, *, replace: bool = False) -> None:
    """Register a backend under ``name``.

    Parameters
    ----------
    name : str
        Registry name, used as ``forward(..., backend=name)``.
    factory : callable or str
        A Backend subclass, a zero-argument callable returning a Backend, or ``"module:attr"``.
        If it has a ``probe()`` classmethod/attribute it is used by
        [`list_backends`][paged_sparse_attn.list_backends].
    replace : bool
        Allow replacing an existing registration (built-ins included).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend(): name must be a non-empty str, got {name!r}")
    with _lock:
        _load_plugins()
        if not replace and (name in _BUILTIN or name in _registered):
            raise ValueError(f"register_backend(): backend {name!r} is already registered (pass replace=True)")
        _registered[name] = factory
        _instances.pop(name, None)
        _broken.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove a runtime registration (and its cached instance). Built-ins cannot be removed."""
    with _lock:
        if name in _BUILTIN and name not in _registered:
            raise ValueError(f"unregister_backend(): {name!r} is a built-in backend")
        _registered.pop(name, None)
        inst = _instances.pop(name, None)
        _broken.pop(name, None)
    if inst is not None:
        inst.close()


def _reset_for_tests() -> None:
    """Forget plugins, registrations and instances (tests of the entry-point machinery)."""
    global _plugins_loaded
    with _lock:
        for inst in _instances.values():
            inst.close()
        _registered.clear()
        _instances.clear()
        _broken.clear()
        _plugins_loaded = False


def _names() -> list[str]:
    _load_plugins()
    return list(dict.fromkeys([*_BUILTIN, *_registered]))


def _factory(name: str) -> Callable[..., Backend]:
    entry = _registered.get(name, _BUILTIN.get(name))
    if entry is None:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; registered: {', '.join(_names())} [R18]"
        )
    if isinstance(entry, str):
        try:
            entry = load_factory(entry)
        except BackendUnavailableError:
            raise
        except Exception as exc:
            raise BackendUnavailableError(
                f"backend {name!r} could not be imported ({type(exc).__name__}: {exc}) [R18]"
            ) from exc
    return entry


def _probe(name: str) -> Availability:
    try:
        factory = _factory(name)
    except BackendUnavailableError as exc:
        return Availability(False, str(exc))
    probe = getattr(factory, "probe", None)
    try:
        if callable(probe):
            avail = probe()
            if isinstance(avail, Availability):
                return avail
            return Availability(bool(avail), "ok" if avail else "probe returned a false value")
        _instantiate(name)
        return Availability(True, "ok")
    except Exception as exc:  # a probe never raises
        return Availability(False, f"probe failed: {type(exc).__name__}: {exc}")


def list_backends() -> dict[str, Availability]:
    """Every registered backend (built-in and plugins) with its availability. Never raises.

    Returns
    -------
    dict of str to Availability
    """
    with _lock:
        return {name: _probe(name) for name in _names()}


def _instantiate(name: str) -> Backend:
    with _lock:
        inst = _instances.get(name)
        if inst is None:
            inst = _factory(name)()
            if not isinstance(inst, Backend):
                raise BackendUnavailableError(
                    f"backend {name!r}: factory returned {type(inst).__name__}, not a Backend [R18]"
                )
            _instances[name] = inst
        return inst


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
        If the backend is unknown or cannot run here; the message says why and how to fix it.
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
        adhoc = name not in _names() and ":" in name
        if adhoc:  # "module:factory": registered only once it is known to work
            _registered[name] = name
        if name in _instances:
            return _instances[name]
        try:
            avail = _probe(name)
            if not avail.ok:
                reason = avail.reason.removesuffix(" [R18]")
                raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason} [R18]")
            try:
                return _instantiate(name)
            except BackendUnavailableError:
                raise
            except Exception as exc:
                raise BackendUnavailableError(
                    f"backend {name!r} failed to start: {type(exc).__name__}: {exc} [R18]"
                ) from exc
        except BackendUnavailableError:
            if adhoc:
                _registered.pop(name, None)
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
