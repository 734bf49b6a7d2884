"""WGSL kernel sources registered for one process: the experiment scripts' variants.

A variant is a kernel source under a name of its own, with a row of the kernel table (usually
the row of the kernel it varies), so the backend builds and caches its pipelines like any other
kernel's. Importing this module routes the shader loader through :data:`SOURCES` first; nothing
outside the importing process changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn.backends.wgpu import _kernels, _sgmat, _shaders
from paged_sparse_attn.backends.wgpu import backend as _backend

__all__ = ["SOURCES", "OneItemPerWorkgroup", "add_arguments", "one_item_per_workgroup", "original", "print_medians",
           "register", "use"]

SOURCES: dict[str, str] = {}
_orig_read = _shaders._read


def _read(name: str) -> str:
    return SOURCES[name] if name in SOURCES else _orig_read(name)


_shaders._read = _read


def original(name: str) -> str:
    """The source of ``shaders/<name>`` as the project has it (never a registered variant)."""
    return _orig_read(name)


def register(name: str, source: str, row: _kernels.Kernel) -> str:
    """Make ``source`` the kernel ``name`` (kernel table row ``row``) in this process; returns ``name``."""
    SOURCES[name] = source
    _kernels.KERNEL_TABLE[name] = row
    _shaders.shader_source.cache_clear()
    return name


class OneItemPerWorkgroup(_sgmat.SgmatGeometry):
    """The geometry of a subgroup-matrix partials kernel from before persistent workgroups (up to
    revision 66a91ec): one workgroup per item, no ``NPW`` constant."""

    @property
    def max_workgroups(self):
        return None

    def constants(self) -> dict[str, int]:
        return {k: v for k, v in super().constants().items() if k != "NPW"}


def one_item_per_workgroup(on: bool = True) -> None:
    """Make the backend plan the subgroup-matrix kernel with :class:`OneItemPerWorkgroup`
    geometries in this process (``on=False``: as the project does)."""
    choose = _sgmat.choose_sgmat_geometry
    _backend.choose_sgmat_geometry = (lambda *a, **kw: OneItemPerWorkgroup(**vars(choose(*a, **kw)))) if on else choose


def use(sources: dict[str, str]) -> None:
    """Make ``sources`` ({kernel file: WGSL}) the kernels of those names in this process, in place
    of the project's files; ``use({})`` goes back to the project's kernels (and drops every
    registered variant)."""
    SOURCES.clear()
    SOURCES.update(sources)
    _shaders.shader_source.cache_clear()


def add_arguments(ap, rounds: int) -> None:
    """The options every variant script takes: ``--backend``, ``--variant LABEL=DIR`` (repeatable),
    ``--no-robustness``, ``--rounds`` (default ``rounds``) and ``--calls``."""
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--variant", action="append", default=[], help="LABEL=DIR: a folder of WGSL files (repeatable)")
    ap.add_argument("--no-robustness", action="store_true",
                    help="also the working tree's kernels on a Dawn device without bounds checks")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--calls", type=int, default=8)


def print_medians(res: dict, width: int = 46) -> None:
    """The median of each variant's rounds, ``res`` = {label: [seconds, ...]}, in milliseconds."""
    import numpy as np

    print("medians:")
    for label, ts in res.items():
        print(f"  {label:{width}s} {np.median(ts) * 1e3:7.3f} ms")
