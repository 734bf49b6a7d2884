"""Geometry of the subgroup-matrix partials kernel (``psa_partials_sgmat.wgsl``) and when it applies.

The kernel is a drop-in for ``psa_partials.wgsl``: same bindings, Params and plan records, so its
geometry is a :class:`~._plan.Geometry` (``RMAX`` rows per work item: the planner's items are
unchanged) with the kernel's name and its own override constants. It applies where the device
has 16x16x16 float16 x float16 -> float32 subgroup matrices (``ctx.sgmat``), the caches are
float16, ``D`` is a multiple of 16, a block fits the kernel's score tile (``BK`` positions) and
a geometry fits the workgroup memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._plan import Geometry

__all__ = ["SGMAT", "SGMAT2", "SGMAT2_R16", "SgmatGeometry", "choose_sgmat_geometry", "sgmat_ineligible", "sgmat_workgroup_bytes",
           "sgmat2_workgroup_bytes"]

SGMAT = "psa_partials_sgmat.wgsl"
# A variant under measurement: K and V read as subgroup matrices straight from storage (no staged
# K/V tiles, no barrier between tiles). Chosen only where VARIANT names it (the default stays SGMAT);
# VARIANT_WG, when set, is its workgroup size (64 or 128), else the largest that fits.
SGMAT2 = "psa_partials_sgmat2.wgsl"
SGMAT2_R16 = "psa_partials_sgmat2_r16.wgsl"  # the same kernel with the capacities of 16-row items (less memory)
VARIANT = SGMAT
VARIANT_WG: int | None = None
# (HCAP2 float16, SCAP float32, CCAP float32) of each variant file's `const` capacities
VARIANT_CAPS = {SGMAT2: (8704, 4224, 1024), SGMAT2_R16: (4352, 2112, 1024)}
SGMAT_CONFIG = (16, 16, 16)  # (M, N, K) of the float16 -> float32 matrices the kernel uses
SUBGROUP = 32                # the kernel's subgroups: 32 consecutive invocations
# the constant capacities of the kernel's matrix arrays (HCAP float16, SCAP float32): keep equal
# to the shader's `const HCAP` / `const SCAP`
HCAP = 13056
SCAP = 4224
MAXDT = 8                    # accumulators per subgroup (the shader's eight named ones)
MAXLD = 8                    # K/V and query units an invocation holds in registers (the shader's LD, LQ)
MAX_HEAD_DIM = 256
NSG_CHOICES = (8, 4, 2, 1)   # subgroups per workgroup, the first that fits


@dataclass(frozen=True)
class SgmatGeometry(Geometry):
    """Geometry of the subgroup-matrix kernel: ``RMAX`` rows per item (a multiple of 16), ``TK``
    keys per K/V tile, ``BK`` positions of a block held at once, ``WG = 32 * subgroups``."""

    kernel: str = SGMAT
    BK: int = 128

    @property
    def workgroup_bytes(self) -> int:
        if self.kernel in VARIANT_CAPS:
            return sgmat2_workgroup_bytes(self.RMAX, self.BK, self.WG, self.kernel)
        return sgmat_workgroup_bytes(self.D, self.RMAX, self.BK, self.WG)

    def constants(self) -> dict[str, int]:
        return {"D": self.D, "S": self.S, "TK": self.TK, "BK": self.BK, "RMAX": self.RMAX, "WG": self.WG}


def sgmat_workgroup_bytes(D: int, RMAX: int, BK: int, WG: int) -> int:
    """Workgroup memory of psa_partials_sgmat.wgsl (each variable rounded to 16 bytes)."""

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    return (a(2 * HCAP) + a(4 * SCAP) + a(4 * BK) + 6 * a(4 * RMAX) + 3 * a(4 * WG)
            + a(4 * RMAX * (D // 16)) + 4 * 16)


def sgmat2_workgroup_bytes(RMAX: int, BK: int, WG: int, kernel: str = SGMAT2) -> int:
    """Workgroup memory of psa_partials_sgmat2.wgsl or its 16-row file (each variable rounded to
    16 bytes)."""
    hcap, scap, ccap = VARIANT_CAPS[kernel]

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    return a(2 * hcap) + a(4 * scap) + a(4 * ccap) + a(4 * BK) + 6 * a(4 * RMAX) + 3 * a(4 * WG) + 16


def _fits2(kernel: str, D: int, S: int, R: int, BK: int, nsg: int) -> bool:
    """psa_partials_sgmat2.wgsl's rules (see its header): 16-position groups inside one page, the
    subgroups' share of o, query units in registers, constant capacities."""
    hcap, scap, ccap = VARIANT_CAPS[kernel]
    nrb = R // 16
    if S % 16 or BK % 16 or nsg > ccap // 256 or nsg % nrb:
        return False
    cs = nsg // nrb
    if (D // 16) % cs or (D // 16) // cs > MAXDT:
        return False
    if -(-R * D // 4 // (SUBGROUP * nsg)) > MAXLD:
        return False
    return 2 * R * max(D + 8, BK + 8) <= hcap and R * (max(BK, D) + 4) <= scap


def _variant(ctx, D: int, S: int, block_size: int, rows_needed: int):
    """(RMAX, BK, WG) of the VARIANT kernel for a call, or None where it does not fit."""
    rows = 32 if rows_needed > 16 else 16
    BK = -(-block_size // 16) * 16
    for R in (rows, 16) if rows == 32 else (16,):
        for nsg in (4, 2, 1):
            WG = SUBGROUP * nsg
            if VARIANT_WG is not None and WG != VARIANT_WG:
                continue
            if WG > ctx.max_invocations or not _fits2(VARIANT, D, S, R, BK, nsg):
                continue
            if sgmat2_workgroup_bytes(R, BK, WG, VARIANT) <= ctx.workgroup_storage:
                return R, BK, WG
    return None


def _fits(D: int, R: int, TK: int, BK: int, nsg: int) -> bool:
    """The kernel's divisibility rules and constant capacities (see its header)."""
    HS, SB = D + 8, max(BK, D) + 4
    nrb = R // 16
    if TK > D or BK % TK or nsg % nrb:
        return False
    cs = nsg // nrb
    if (D // 16) % cs or (D // 16) // cs > MAXDT:
        return False
    wg = SUBGROUP * nsg
    if -(-TK * D // 8 // wg) > MAXLD or -(-R * D // 4 // wg) > MAXLD:  # K/V and query units in registers
        return False
    return (2 * R + TK) * HS <= HCAP and R * SB <= SCAP


def sgmat_ineligible(ctx, *, D: int, kv_itemsize: int, block_size: int, rows_needed: int) -> str | None:
    """Why the subgroup-matrix kernel cannot run these calls on ``ctx``, or None."""
    if SGMAT_CONFIG not in getattr(ctx, "sgmat", frozenset()):
        return "the device has no 16x16x16 float16 -> float32 subgroup matrices"
    if kv_itemsize != 2:
        return "the caches are not float16"
    if D % 16 or D > MAX_HEAD_DIM:
        return f"head_dim {D} is not a multiple of 16 up to {MAX_HEAD_DIM}"
    size = getattr(ctx, "subgroup", (None, ""))[0]
    if size is not None and size != SUBGROUP:
        return f"the device's subgroup size is {size}, the kernel needs {SUBGROUP}"
    if _candidates(ctx, D, block_size, rows_needed) is None:
        return (f"no geometry for head_dim {D} and blocks of {block_size} positions fits "
                f"{ctx.workgroup_storage} bytes of workgroup memory and the kernel's tiles")
    return None


def _candidates(ctx, D: int, block_size: int, rows_needed: int):
    """(RMAX, TK, BK, WG) of the first geometry that fits, or None.

    Rows: 32 when a work item can hold more than 16 (prefill: 4 queries x 8 heads share each K/V
    tile), else 16. TK = 32 keys per tile where it fits (half the barriers of 16). Subgroups: as
    many as the tiles divide among (4 for RMAX = 32: every subgroup one score tile per K tile and
    a quarter of o).
    """
    rows = 32 if rows_needed > 16 else 16
    for R in (rows, 16) if rows == 32 else (16,):
        for TK in (32, 16):
            BK = -(-block_size // TK) * TK
            for nsg in NSG_CHOICES:
                WG = SUBGROUP * nsg
                if WG > ctx.max_invocations or not _fits(D, R, TK, BK, nsg):
                    continue
                if sgmat_workgroup_bytes(D, R, BK, WG) <= ctx.workgroup_storage:
                    return R, TK, BK, WG
    return None


def choose_sgmat_geometry(ctx, *, D: int, S: int, G: int, block_size: int, rows_needed: int,
                          kv_itemsize: int) -> SgmatGeometry:
    """The subgroup-matrix geometry of a call (``sgmat_ineligible`` must have returned None).

    Where ``VARIANT`` names a variant file (``SGMAT2``, ``SGMAT2_R16``) that fits the call, its
    geometry; else SGMAT's.
    """
    if VARIANT in VARIANT_CAPS:
        v = _variant(ctx, D, S, block_size, rows_needed)
        if v is not None:
            R, BK, WG = v
            return SgmatGeometry(D=D, S=S, G=G, TK=16, RMAX=R, WG=WG, TD=-(-D // 4), kv_itemsize=kv_itemsize,
                                 kernel=VARIANT, BK=BK)
    R, TK, BK, WG = _candidates(ctx, D, block_size, rows_needed)
    return SgmatGeometry(D=D, S=S, G=G, TK=TK, RMAX=R, WG=WG, TD=-(-D // 4), kv_itemsize=kv_itemsize, BK=BK)
