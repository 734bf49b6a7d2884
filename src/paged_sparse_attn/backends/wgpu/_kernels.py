"""The one table of the wgpu backend's kernels, and the one place their pipelines are made.

Each WGSL file of ``shaders/`` that the backend dispatches has a row: its bindings (in binding
order: ``u`` uniform, ``r`` read-only storage, ``w`` read-write storage), whether it has a
float16 variant (``alias kv_t``), and whether it may be compiled without runtime checks (only
kernels whose every index the host or the kernel itself proves in range). Pipelines are cached
per device by (kernel, entry point, float16, checks, override constants).

Every kernel is trusted today, so both runtimes run them without checks by default: ``wgpu``
compiles each trusted kernel without naga's checks, ``dawn`` opens its device without its
bounds checks (which it applies to every kernel or none) only while ``all_trusted()`` holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedError
from ._device import DeviceContext, create_shader_module, device_errors
from ._shaders import shader_source
from ._webgpu import BufferBindingType, ShaderStage

__all__ = ["KERNEL_TABLE", "SGMAT_SHAPE", "Kernel", "all_trusted", "kernel_source", "pipeline"]

SGMAT_SHAPE = (16, 16, 16)
"""The subgroup-matrix configuration (M, N, K; f16 x f16 -> f32) the tensor-core kernels use."""


@dataclass(frozen=True)
class Kernel:
    """A row of the kernel table."""

    bindings: str            # binding kinds in order: u (uniform), r (read-only storage), w (storage)
    f16: bool = False        # has a float16 variant (kv_t aliased to f16)
    trusted: bool = False    # may be compiled without runtime checks (every index proved in range)
    subgroups: bool = False  # uses subgroup builtins (Tint wants `enable subgroups;`, naga refuses it)
    sgmat: bool = False      # uses subgroup matrices: compiled only where (16, 16, 16) is in ctx.sgmat;
                             # the loader prepends `enable f16;` and the subgroup-matrix directive


KERNEL_TABLE: dict[str, Kernel] = {
    # attention (R14, R15)
    "psa_partials.wgsl": Kernel("urrrrww", f16=True, trusted=True),
    "psa_partials_decode.wgsl": Kernel("urrrrww", trusted=True, subgroups=True),  # caches as 16-byte units, any dtype
    "psa_partials_sgmat.wgsl": Kernel("urrrrww", trusted=True, sgmat=True),  # float16 caches, tensor cores
    "psa_merge.wgsl": Kernel("urrrww", trusted=True),
    # a planned decode layer's R6 error words into its results (indexes fixed by the host's plan)
    "psa_handoff.wgsl": Kernel("ww", trusted=True),
    # a layer's float16 q widened into the plan's float32 q (R7); words past N2 are never read
    "psa_widen.wgsl": Kernel("rw", trusted=True),
    # the KV-outer inversion on the device (R13, R31, R33): it tests every id of a device
    # selection against [-1, msb) and the query's visible blocks before the id indexes anything,
    # and a row keeps at most K edges in its own ranges (repeated ids reported, R6); the rest of
    # its indexes come from the validated layout and the scan of its own flags
    "psa_invert.wgsl": Kernel("urrwrwwww", trusted=True),
    "psa_scan.wgsl": Kernel("urw", trusted=True),
    # the index branch (R22, R24); its indexes come from validated index arrays and block tables
    # and the host's plan, like the attention kernels'
    "psa_block_scores.wgsl": Kernel("urrrrw", f16=True, trusted=True, subgroups=True),
    "psa_block_scores_decode.wgsl": Kernel("urrrrw", f16=True, trusted=True),
    "psa_block_scores_decode_sg.wgsl": Kernel("urrrrw", trusted=True, subgroups=True),  # index keys as 16-byte units
    "psa_block_scores_sgmat.wgsl": Kernel("urrrrw", trusted=True, sgmat=True),  # float16 HND index keys, tensor cores
    "psa_select_topk.wgsl": Kernel("urrw", trusted=True),
    # block-score keys decoded to float32 where they are, before block_scores() reads them back
    # (each invocation one word below the params' count)
    "psa_score_keys.wgsl": Kernel("uw", trusted=True),
    # ceilings the benchmark measures (no attention kernel); the host runs them only on shapes
    # that are whole blocks of the variant (the variant's ``unfit`` in ``_ceilings``)
    "psa_gemm_sgmat.wgsl": Kernel("urrw", trusted=True, sgmat=True),
    "psa_gemm_sgmat_tiled.wgsl": Kernel("urrw", trusted=True, sgmat=True),  # operands staged in workgroup memory
}


def all_trusted() -> bool:
    """Whether every kernel of the table may run without runtime checks (``dawn``'s default)."""
    return all(k.trusted for k in KERNEL_TABLE.values())


def kernel_source(ctx: DeviceContext, kernel: str, *, f16: bool = False) -> str:
    """WGSL of ``kernel`` as ``ctx``'s runtime compiles it (the directives its compiler wants)."""
    row = KERNEL_TABLE[kernel]
    src = shader_source(kernel, f16=f16 and row.f16)
    if row.sgmat:
        if SGMAT_SHAPE not in ctx.sgmat:
            raise UnsupportedError(f"{kernel} needs {SGMAT_SHAPE[0]}x{SGMAT_SHAPE[1]}x{SGMAT_SHAPE[2]} f16 subgroup "
                                   f"matrices, which {ctx.summary} does not offer [R18]")
        src = "enable f16;\nenable chromium_experimental_subgroup_matrix;\n" + src
    if row.subgroups or row.sgmat:
        src = ctx.runtime.subgroup_directive + src
    return src


def _layout(ctx: DeviceContext, kernel: str):
    hit = ctx.layouts.get(kernel)
    if hit is None:
        t = {"u": BufferBindingType.uniform, "r": BufferBindingType.read_only_storage,
             "w": BufferBindingType.storage}
        entries = [{"binding": i, "visibility": ShaderStage.COMPUTE, "buffer": {"type": t[k]}}
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
        with device_errors(f"pipeline creation of {kernel}:{entry}", f16=f16, **constants):
            module = create_shader_module(ctx.device, kernel_source(ctx, kernel, f16=f16), kernel, checks=checks,
                                          runtime=ctx.runtime)
            pipe = ctx.device.create_compute_pipeline(
                layout=pl, compute={"module": module, "entry_point": entry, "constants": constants},
                label=f"{kernel}:{entry}")
        hit = ctx.pipelines[key] = (pipe, bgl)
    return hit
