"""The WGSL backends: ``wgpu`` (wgpu-native) and ``dawn`` (Dawn), one host code; imported lazily by the registry.

Importing this package imports neither ``wgpu`` nor ``wgpudawn``: that happens when a backend is probed or built.
"""

from ._arrays import WgpuArray
from .backend import DawnBackend, WgpuBackend

__all__ = ["DawnBackend", "WgpuArray", "WgpuBackend"]
