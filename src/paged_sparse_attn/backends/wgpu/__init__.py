"""The wgpu backend (WGSL kernels through wgpu-py); imported lazily by the registry.

Importing this package does not import ``wgpu``: that happens when a backend is probed or built.
"""

from ._arrays import WgpuArray
from .backend import WgpuBackend

__all__ = ["WgpuBackend", "WgpuArray"]
