"""WebGPU's flag and enum values, as the WebGPU specification defines them.

Both runtimes (wgpu-native and Dawn, through the same Python API) take these plain values, so the
host code needs no runtime module to spell a buffer usage or a binding type.
"""

from __future__ import annotations

__all__ = ["BufferBindingType", "BufferUsage", "MapMode", "QueryType", "ShaderStage"]


class BufferUsage:
    MAP_READ = 0x0001
    MAP_WRITE = 0x0002
    COPY_SRC = 0x0004
    COPY_DST = 0x0008
    INDEX = 0x0010
    VERTEX = 0x0020
    UNIFORM = 0x0040
    STORAGE = 0x0080
    INDIRECT = 0x0100
    QUERY_RESOLVE = 0x0200


class MapMode:
    READ = 0x0001
    WRITE = 0x0002


class ShaderStage:
    VERTEX = 0x1
    FRAGMENT = 0x2
    COMPUTE = 0x4


class BufferBindingType:
    uniform = "uniform"
    storage = "storage"
    read_only_storage = "read-only-storage"


class QueryType:
    timestamp = "timestamp"
