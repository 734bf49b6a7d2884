"""The trust boundary on the way back: what a backend hands to the API is checked before use.

A backend is code the package does not control (plugins, ``module:factory`` backends). Every
array it returns -- block scores, a selection, partials, ``out`` and ``lse`` -- is checked here
for its type, shape and dtype before the API uses it or hands it to the caller, and a selection
is checked for the rules that make it safe to feed to ``forward`` (R6: ids in ``[-1, msb)``,
unique per row). A failure raises :class:`~paged_sparse_attn.DeviceError` naming the function,
the backend, what was expected and what was got: a backend bug, never the caller's.

The checks are cheap on purpose (they run on every call): shape and dtype always, and O(n)
value checks only for selections. Values of a :class:`~paged_sparse_attn.DeviceArray` output
stay on the device, so only its shape and dtype are checked here; the backend that returns it
answers for its values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._types import DeviceArray, Partials
from .errors import DeviceError

__all__ = ["backend_label", "checked_array", "checked_out_lse", "checked_partials", "checked_scores",
           "checked_selection"]


def backend_label(backend: Any) -> str:
    """How messages name a backend: its ``name``, plus its registry name where that differs."""
    # imported late: the registry imports the backends, which import this module's users
    from .registry import registry_name

    name = getattr(backend, "name", type(backend).__name__)
    reg = registry_name(backend)
    return f"{name!r}" if reg is None or reg == name else f"{name!r} (registered as {reg!r})"


def _got(x: Any) -> str:
    if isinstance(x, (np.ndarray, DeviceArray)):
        return f"{np.dtype(x.dtype).name} {tuple(x.shape)}"
    return type(x).__name__


def checked_array(backend: Any, fn: str, what: str, x: Any, shape: tuple[int, ...],
                  dtype: Any = np.float32, *, rule: str) -> Any:
    """``x`` if it is a numpy array or DeviceArray of exactly ``shape`` and ``dtype``, else DeviceError.

    Parameters
    ----------
    backend : Backend
        The backend that returned ``x`` (named in the message).
    fn : str
        The public function that called the backend.
    what : str
        What ``x`` is, e.g. ``"out"``.
    x : any
        The backend's result.
    shape : tuple of int
    dtype : numpy dtype
    rule : str
        The rule that defines ``x`` (ends the message, e.g. ``"R11"``).

    Returns
    -------
    ndarray or DeviceArray
        ``x`` itself, never a converted copy (no silent cast).
    """
    want = np.dtype(dtype)
    ok = isinstance(x, (np.ndarray, DeviceArray)) and tuple(x.shape) == tuple(shape) \
        and np.dtype(x.dtype) == want
    if not ok:
        raise DeviceError(f"{fn}(): backend {backend_label(backend)} returned {what} as {_got(x)}, "
                          f"expected {want.name} {tuple(shape)} (a backend bug) [{rule}]")
    return x


def checked_out_lse(backend: Any, fn: str, result: Any, q_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """A backend's ``forward`` / ``combine_partials`` result: ``(out [Tq, Hq, D], lse [Tq, Hq])``, float32."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise DeviceError(f"{fn}(): backend {backend_label(backend)} returned {type(result).__name__}, "
                          "expected a tuple (out, lse) (a backend bug) [R11]")
    out, lse = result
    return (checked_array(backend, fn, "out", out, tuple(q_shape), rule="R11"),
            checked_array(backend, fn, "lse", lse, tuple(q_shape[:2]), rule="R11"))


def checked_partials(backend: Any, fn: str, partials: Any, num_edges: int, group_size: int,
                     head_dim: int) -> Partials:
    """A backend's R14 partials: ``o [E, G, D]``, ``m [E, G]``, ``l [E, G]``, float32."""
    if not isinstance(partials, Partials):
        raise DeviceError(f"{fn}(): backend {backend_label(backend)} returned {type(partials).__name__}, "
                          "expected Partials (a backend bug) [R14]")
    E, G, D = num_edges, group_size, head_dim
    checked_array(backend, fn, "partials.o", partials.o, (E, G, D), rule="R14")
    checked_array(backend, fn, "partials.m", partials.m, (E, G), rule="R14")
    checked_array(backend, fn, "partials.l", partials.l, (E, G), rule="R14")
    return partials


def checked_scores(backend: Any, fn: str, scores: Any, shape: tuple[int, int, int]) -> Any:
    """A backend's R22 block scores: float32 ``[Tq, Hkv, msb]``."""
    return checked_array(backend, fn, "block scores", scores, shape, rule="R22")


def checked_selection(backend: Any, fn: str, selected: Any, shape: tuple[int, int, int], msb: int) -> Any:
    """A backend's R24 selection, checked so that it is a valid ``selected`` (R6).

    int32 ``[Tq, Hkv, topk]`` always; for a host array also every id in ``[-1, msb)`` and no id
    twice in a row (O(n log topk)), so that the selection can never index out of bounds nor
    count a block twice when ``sparse_attention`` feeds it to the forward.
    """
    s = checked_array(backend, fn, "a selection", selected, shape, np.int32, rule="R24")
    if isinstance(s, DeviceArray) or s.size == 0:
        return s
    lo, hi = int(s.min()), int(s.max())
    if lo < -1 or hi >= msb:
        bad = lo if lo < -1 else hi
        at = tuple(int(i) for i in np.argwhere(s == bad)[0])
        raise DeviceError(f"{fn}(): backend {backend_label(backend)} returned a selection with block id "
                          f"{bad} at {at}, expected ids in [-1, {msb}) (a backend bug) [R6]")
    srt = np.sort(s, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if dup.any():
        t, h, j = (int(i) for i in np.argwhere(dup)[0])
        raise DeviceError(f"{fn}(): backend {backend_label(backend)} returned a selection whose row [{t}, {h}] "
                          f"repeats block id {int(srt[t, h, j])}, expected unique ids per row "
                          "(a backend bug) [R6]")
    return s
