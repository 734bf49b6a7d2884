"""Finding and specialising the WGSL kernels.

The repository keeps the kernels in ``shaders/`` at its top level; the wheel ships the same files
inside the package as ``paged_sparse_attn/shaders/``. The package copy is looked up first (through
:mod:`importlib.resources`), then the repository copy.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

__all__ = ["shader_source", "shader_path"]

# src/paged_sparse_attn/backends/wgpu/_shaders.py -> parents[4] is the repository root
_REPO_SHADERS = Path(__file__).resolve().parents[4] / "shaders"
_KV_ALIAS = "alias kv_t = f32;"


def shader_path(name: str) -> str:
    """Where ``name`` (e.g. ``"psa_partials.wgsl"``) is read from: package copy, else repository copy."""
    try:
        res = importlib.resources.files("paged_sparse_attn").joinpath("shaders", name)
        if res.is_file():
            return str(res)
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = _REPO_SHADERS / name
    if path.is_file():
        return str(path)
    raise FileNotFoundError(
        f"WGSL kernel {name!r} not found in the package (paged_sparse_attn/shaders/) nor in the "
        f"repository ({_REPO_SHADERS}); reinstall paged_sparse_attn"
    )


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    try:
        return importlib.resources.files("paged_sparse_attn").joinpath("shaders", name).read_text("utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, OSError):
        return Path(shader_path(name)).read_text("utf-8")


@functools.lru_cache(maxsize=None)
def shader_source(name: str, *, f16: bool = False) -> str:
    """WGSL text of kernel ``name``; ``f16=True`` selects float16 K/V storage.

    The float16 variant is the same file with its ``alias kv_t = f32;`` line rewritten to f16 and
    ``enable f16;`` prepended (the device must have the ``shader-f16`` feature).
    """
    src = _read(name)
    if f16:
        if _KV_ALIAS not in src:
            raise ValueError(f"{name} has no '{_KV_ALIAS}' line, it cannot be specialised for float16")
        src = "enable f16;\n" + src.replace(_KV_ALIAS, "alias kv_t = f16;", 1)
    return src
