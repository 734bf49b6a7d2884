"""Compile every kernel of the table with Tint (Dawn's shader compiler) without a GPU.

Dawn's Null adapter parses and validates WGSL exactly as a GPU adapter does, then runs nothing;
this is how a machine without a GPU driver Dawn accepts (continuous integration on lavapipe)
still checks that every shader compiles under Tint as well as under naga.
"""

from __future__ import annotations

from types import SimpleNamespace

from ._kernels import KERNEL_TABLE, SGMAT_SHAPE, kernel_source
from ._runtime import DAWN

__all__ = ["null_context", "null_device", "tint_check"]

# Shaders outside the kernel table (a probe and a bandwidth ceiling), compiled as they are
# compiled at run time: (file, needs the subgroup directive).
EXTRA_SHADERS = (("psa_subgroup_size.wgsl", True), ("psa_read_bandwidth.wgsl", False))


def null_device():
    """A device of Dawn's Null adapter with the features the kernels need (Tint, no GPU)."""
    adapter = DAWN.null_adapter()
    feats = [f for f in ("shader-f16", DAWN.subgroup_feature, DAWN.sgmat_feature) if f in adapter.features]
    return adapter.request_device_sync(required_features=feats)


def null_context() -> SimpleNamespace:
    """What ``kernel_source`` reads of a device context, for Dawn with 16x16x16 subgroup matrices
    (so that every kernel of the table, the tensor-core ones included, gets its directives)."""
    return SimpleNamespace(runtime=DAWN, sgmat=frozenset({SGMAT_SHAPE}), summary="Dawn's Null adapter")


def tint_check() -> dict[str, str | None]:
    """Compile every kernel variant (float32 / float16) with Tint on Dawn's Null adapter.

    Returns
    -------
    dict
        ``{"kernel.wgsl" or "kernel.wgsl[f16]": None if it compiled, else Tint's message}``.
        Raises ImportError when ``wgpudawn`` is not installed.
    """
    from ._shaders import shader_source

    device = null_device()
    ctx = null_context()
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
