"""Compile every kernel of the table with Tint (Dawn's shader compiler) without a GPU.

Dawn's Null adapter parses and validates WGSL exactly as a GPU adapter does, then runs nothing;
this is how a machine without a GPU driver Dawn accepts (continuous integration on lavapipe)
still checks that every shader compiles under Tint as well as under naga.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from ._kernels import KERNEL_TABLE, SGMAT_SHAPE, kernel_source
from ._runtime import DAWN

__all__ = ["tint_check"]

# Shaders outside the kernel table (a probe and a bandwidth ceiling), compiled as they are
# compiled at run time: (file, needs the subgroup directive).
EXTRA_SHADERS = (("psa_subgroup_size.wgsl", True), ("psa_read_bandwidth.wgsl", False))


def _null_device():
    gpu = DAWN.gpu()
    old = os.environ.get("WGPU_BACKEND_TYPE")
    os.environ["WGPU_BACKEND_TYPE"] = "Null"  # read when the adapter is requested
    try:
        adapter = gpu.gpu.request_adapter_sync()
    finally:
        if old is None:
            del os.environ["WGPU_BACKEND_TYPE"]
        else:
            os.environ["WGPU_BACKEND_TYPE"] = old
    feats = [f for f in ("shader-f16", DAWN.subgroup_feature, DAWN.sgmat_feature) if f in adapter.features]
    return adapter.request_device_sync(required_features=feats)


def tint_check() -> dict[str, str | None]:
    """Compile every kernel variant (float32 / float16) with Tint on Dawn's Null adapter.

    Returns
    -------
    dict
        ``{"kernel.wgsl" or "kernel.wgsl[f16]": None if it compiled, else Tint's message}``.
        Raises ImportError when ``wgpudawn`` is not installed.
    """
    from ._shaders import shader_source

    device = _null_device()
    ctx = SimpleNamespace(runtime=DAWN, sgmat=frozenset({SGMAT_SHAPE}), summary="Dawn's Null adapter")
    sources = {}
    for name, row in KERNEL_TABLE.items():
        sources[name] = kernel_source(ctx, name)
        if row.f16:
            sources[f"{name}[f16]"] = kernel_source(ctx, name, f16=True)
    for name, subgroups in EXTRA_SHADERS:
        sources[name] = (DAWN.subgroup_directive if subgroups else "") + shader_source(name)
    result: dict[str, str | None] = {}
    for label, src in sources.items():
        try:
            device.create_shader_module(code=src, label=label)
            result[label] = None
        except Exception as exc:  # Tint's message is the result
            result[label] = str(exc)
    device.destroy()
    return result
