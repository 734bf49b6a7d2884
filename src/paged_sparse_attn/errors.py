"""The package's exceptions (R17, R18).

Every error raised on purpose by paged_sparse_attn derives from ``PagedSparseAttnError``,
so callers can catch the whole family, or the standard base class each one also derives from.
"""

from __future__ import annotations

__all__ = [
    "PagedSparseAttnError",
    "SpecError",
    "UnsupportedError",
    "BackendUnavailableError",
    "DeviceError",
]


class PagedSparseAttnError(Exception):
    """Root of every error this package raises on purpose."""


class SpecError(PagedSparseAttnError, ValueError):
    """An input violates a rule on valid inputs: R1-R8, R13, R14, R16, R21, R23 or R25 (R17).

    The message names the function, the argument, what was expected, what was got and the rule
    id, e.g. ``forward(): selected contains block id 9 >= msb=8 at [3, 0, 2] [R6]``. Raised before
    any backend or device work starts.

    Attributes
    ----------
    rule : str
        The rule id that was violated, e.g. ``"R6"``.
    """

    def __init__(self, message: str, rule: str = ""):
        super().__init__(message)
        self.rule = rule


class UnsupportedError(PagedSparseAttnError, NotImplementedError):
    """A valid problem that the chosen backend cannot run (R18), e.g. float16 without shader-f16."""


class BackendUnavailableError(PagedSparseAttnError, RuntimeError):
    """The requested backend is not registered or cannot run here; the message says how to fix it."""


class DeviceError(PagedSparseAttnError, RuntimeError):
    """A device-side failure (validation error, out of memory, device lost) with its context,
    or a backend result that breaks the backend contract (wrong shape or dtype, a selection
    that breaks R6), found by the API before the result is used.

    The message names the kernel or operation and the sizes involved. The backend that raised it
    can be used again afterwards (it acquires a new device if the old one was lost).
    """
