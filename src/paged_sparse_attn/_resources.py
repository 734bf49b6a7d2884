"""Process resources that long-running callers (and the reliability tests) watch.

* ``rss_bytes`` -- resident memory of this process now (``/proc/self/statm``), and
  ``peak_rss_bytes`` -- its peak so far;
* ``wgpu_object_counts`` -- live wgpu objects (buffers, pipelines, ...) as wgpu-py's
  diagnostics count them.

Nothing here imports ``wgpu``: when it has not been imported, there is nothing to count.
"""

from __future__ import annotations

import os
import sys

__all__ = ["rss_bytes", "peak_rss_bytes", "wgpu_object_counts"]


def rss_bytes() -> int | None:
    """Resident set size of this process in bytes, or None where ``/proc`` is missing (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process in bytes (``getrusage``), or None where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes, Linux: KiB


def wgpu_object_counts() -> dict[str, int]:
    """Live wgpu objects by kind, e.g. ``{"Buffer": 2, "buffer_bytes": 400, "native_Buffer": 2, ...}``.

    ``<Kind>`` counts the Python objects wgpu-py holds (created and not yet garbage collected),
    ``buffer_bytes`` the bytes of those buffers, ``native_<Kind>`` the objects wgpu-native still
    keeps. Empty when ``wgpu`` has not been imported (then there are none).
    """
    wgpu = sys.modules.get("wgpu")
    if wgpu is None:
        return {}
    out: dict[str, int] = {}
    diag = getattr(wgpu, "diagnostics", None)
    try:
        for kind, d in diag.object_counts.get_dict().items():
            if kind != "total":
                out[kind] = int(d.get("count", 0))
                if kind == "Buffer":
                    out["buffer_bytes"] = int(d.get("resource_mem", 0))
    except Exception:  # diagnostics are best effort: never fail the caller
        pass
    try:
        for kind, d in diag.wgpu_native_counts.get_dict().items():
            if kind != "total":
                out[f"native_{kind}"] = int(d.get("count", 0))
    except Exception:
        pass
    return out
