"""The one table of the wgpu backend's kernels, and the one place their pipelines are made.

Each WGSL file of ``shaders/`` that the backend dispatches has a row: its bindings (in binding
order: ``u`` uniform, ``r`` read-only storage, ``w`` read-write storage), whether it has a
float16 variant (``alias kv_t``), and whether it may be compiled without runtime checks (only
kernels whose every index the host or a checking kernel proves in range). Pipelines are cached
per device by (kernel, entry point, float16, checks, override constants).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._device import DeviceContext, create_shader_module, device_errors
from ._shaders import shader_source

__all__ = ["Kernel", "KERNEL_TABLE", "pipeline"]

SGMAT_ENABLES = "enable f16;\nenable chromium_experimental_subgroup_matrix;\n"


@dataclass(frozen=True)
class Kernel:
    """A row of the kernel table."""

    bindings: str          # binding kinds in order: u (uniform), r (read-only storage), w (storage)
    f16: bool = False      # has a float16 variant (kv_t aliased to f16)
    trusted: bool = False  # may be compiled without runtime checks (every index proved in range)
    sgmat: bool = False    # uses subgroup matrices: f16 and the subgroup-matrix extension are enabled


KERNEL_TABLE: dict[str, Kernel] = {
    # attention (R14, R15)
    "psa_partials.wgsl": Kernel("urrrrww", f16=True, trusted=True),
    "psa_partials_decode.wgsl": Kernel("urrrrww", trusted=True),  # caches as 16-byte units, any dtype
    "psa_merge.wgsl": Kernel("urrrww", trusted=True),
    # the KV-outer inversion on the device (R13, R31, R33)
    "psa_invert.wgsl": Kernel("urrwrwwww"),
    "psa_scan.wgsl": Kernel("urw"),
    # the index branch (R22, R24)
    "psa_block_scores.wgsl": Kernel("urrrrw", f16=True),
    "psa_block_scores_decode.wgsl": Kernel("urrrrw", f16=True),
    "psa_block_scores_sgmat.wgsl": Kernel("urrrrw", sgmat=True),  # float16 index keys only
    "psa_select_topk.wgsl": Kernel("urrw"),
}


def _layout(ctx: DeviceContext, kernel: str):
    import wgpu

    hit = ctx.layouts.get(kernel)
    if hit is None:
        t = {"u": wgpu.BufferBindingType.uniform, "r": wgpu.BufferBindingType.read_only_storage,
             "w": wgpu.BufferBindingType.storage}
        entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": t[k]}}
                   for i, k in enumerate(KERNEL_TABLE[kernel].bindings)]
        with device_errors(f"bind group layout of {kernel}"):
            bgl = ctx.device.create_bind_group_layout(entries=entries)
            hit = ctx.layouts[kernel] = (bgl, ctx.device.create_pipeline_layout(bind_group_layouts=[bgl]))
    return hit


def pipeline(ctx: DeviceContext, kernel: str, constants: dict, *, entry: str = "main", f16: bool = False,
             checks: bool = True):
    """``(pipeline, bind group layout)`` of ``kernel``'s ``entry`` with these override constants.

    ``f16`` selects the float16 variant where the kernel has one (else it is ignored: such
    kernels read every dtype the same way); ``checks=False`` compiles without runtime checks,
    only for kernels the table marks trusted.
    """
    row = KERNEL_TABLE[kernel]
    f16 = bool(f16) and row.f16
    checks = bool(checks) or not row.trusted
    key = (kernel, entry, f16, checks, tuple(sorted(constants.items())))
    hit = ctx.pipelines.get(key)
    if hit is None:
        bgl, pl = _layout(ctx, kernel)
        src = shader_source(kernel, f16=f16)
        if row.sgmat:
            if (16, 16, 16) not in getattr(ctx, "sgmat", frozenset()):
                raise ValueError(f"{kernel} needs f16 16x16x16 subgroup matrices, which this device lacks")
            src = SGMAT_ENABLES + src
        with device_errors(f"pipeline creation of {kernel}:{entry}", f16=f16, **constants):
            module = create_shader_module(ctx.device, src, kernel, checks=checks)
            pipe = ctx.device.create_compute_pipeline(
                layout=pl, compute={"module": module, "entry_point": entry, "constants": constants},
                label=f"{kernel}:{entry}")
        hit = ctx.pipelines[key] = (pipe, bgl)
    return hit
