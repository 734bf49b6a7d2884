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

__all__ = ["SGMAT", "SgmatGeometry", "choose_sgmat_geometry", "sgmat_ineligible", "sgmat_words",
           "sgmat_workgroup_bytes"]

SGMAT = "psa_partials_sgmat.wgsl"
SGMAT_CONFIG = (16, 16, 16)  # (M, N, K) of the float16 -> float32 matrices the kernel uses
SUBGROUP = 32                # the kernel's subgroups: 32 consecutive invocations
# the constant capacity of the kernel's array of 16-byte words: keep equal to the shader's
# `const WCAP`
WCAP = 2784
MAXDT = 8                    # accumulators per subgroup (the shader's eight named ones)
MAXLD = 8                    # K/V and query units an invocation holds in registers (the shader's LD, LQ)
MAX_HEAD_DIM = 256           # (the shader's 16 pairs of named query matrices)
NK_CHOICES = (8, 16, 32)     # positions per softmax invocation (the shader's NK): whole words of
                             # weights, at most 32 scores in registers, their codes within one u32
NSG_CHOICES = (8, 4, 2, 1)   # subgroups per workgroup, the first that fits (16 first for 64 rows)
# workgroups of a dispatch (each runs every NPW-th item, reading the next item while it works on
# one): at least what a large GPU keeps resident (WebGPU does not tell how many SMs a device
# has), few enough that each runs tens of items of a prefill layer (each workgroup's first item
# starts cold). Measured on an H200 (132 SMs; partials and combine of the prefill layer): 132,
# 264 and 528 workgroups 4.10 ms, 1024 4.22, 2048 4.24, one per item (32768) 4.51
PERSISTENT_WORKGROUPS = 528


@dataclass(frozen=True)
class SgmatGeometry(Geometry):
    """Geometry of the subgroup-matrix kernel: ``RMAX`` rows per item (a multiple of 16), ``TK``
    keys per K/V tile, ``BK`` positions of a block held at once, ``WG = 32 * subgroups``."""

    kernel: str = SGMAT
    BK: int = 128
    NPW: int = PERSISTENT_WORKGROUPS

    @property
    def workgroup_bytes(self) -> int:
        return sgmat_workgroup_bytes(self.D, self.RMAX, self.BK)

    @property
    def max_workgroups(self) -> int:
        return self.NPW

    def constants(self) -> dict[str, int]:
        return {"D": self.D, "S": self.S, "TK": self.TK, "BK": self.BK, "RMAX": self.RMAX, "WG": self.WG,
                "NPW": self.NPW}


def sgmat_workgroup_bytes(D: int, RMAX: int, BK: int) -> int:
    """Workgroup memory of psa_partials_sgmat.wgsl (each variable rounded to 16 bytes; the
    workgroup size takes none: the softmax reduces with shuffles)."""

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    # the word array, key_src, row_q, row_qmax, poison, and two vec4<u32> of flags (a row's m, l,
    # scaling and edge length live in its last word of the array)
    return 16 * WCAP + a(4 * BK) + 2 * a(4 * RMAX) + a(4 * RMAX * (D // 16)) + 2 * 16


def sgmat_words(D: int, R: int, TK: int, BK: int) -> int:
    """Words (16 bytes) of the kernel's array a geometry uses: R rows of SW words (the split
    query, scores, split weights and their codes: a bit per position), then the K/V tile's TK
    rows of HW words (the shader's header)."""
    pw = max(D, BK) // 8 + -(-BK // 128)
    return R * (2 * pw + 1) + TK * (D // 8 + 1)


def _fits(D: int, R: int, TK: int, BK: int, nsg: int) -> bool:
    """The kernel's divisibility rules and constant capacity (see its header)."""
    nrb = R // 16
    if TK > D or BK % TK or nsg % nrb:
        return False
    cs = nsg // nrb
    if (D // 16) % cs or (D // 16) // cs > MAXDT:
        return False
    wg = SUBGROUP * nsg
    if -(-TK * D // 8 // wg) > MAXLD or -(-R * D // 4 // wg) > MAXLD:  # K/V and query units in registers
        return False
    sl = wg // R  # softmax lanes per row: one butterfly within a subgroup
    if sl < 1 or sl & (sl - 1) or sl > SUBGROUP:
        return False
    if BK % sl or BK // sl not in NK_CHOICES:
        return False
    return sgmat_words(D, R, TK, BK) <= WCAP


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

    Rows: 64 when a work item can hold more than 32 (prefill: 8 queries x 8 heads share each K/V
    tile), 32 when it can hold more than 16, else 16, and fewer where the larger does not fit.
    TK = 32 keys per tile where it fits (half the barriers of 16). BK = the block rounded up to
    8, 16 or 32 positions per softmax lane and whole K tiles. Subgroups: 16 for RMAX = 64 where
    they fit (every subgroup one score tile per K tile, half of them idle, and a sixteenth of o:
    more subgroups to hide each phase's waits), else as many as the tiles divide among.
    """
    rows = 64 if rows_needed > 32 else 32 if rows_needed > 16 else 16
    for R in (r for r in (64, 32, 16) if r <= rows):
        for TK in (32, 16):
            for nsg in ((16,) if R == 64 else ()) + NSG_CHOICES:
                WG = SUBGROUP * nsg
                # BK: the block rounded up to one of NK_CHOICES positions per softmax lane and to
                # whole K tiles (positions past the block are zeros; _fits rejects nk > 32)
                sl = max(1, WG // R)
                need = max(-(-block_size // sl), -(-TK // sl))
                BK = sl * next((c for c in NK_CHOICES if c >= need), 2 * NK_CHOICES[-1])
                if BK % TK or WG > ctx.max_invocations or not _fits(D, R, TK, BK, nsg):
                    continue
                if sgmat_workgroup_bytes(D, R, BK) <= ctx.workgroup_storage:
                    return R, TK, BK, WG
    return None


def choose_sgmat_geometry(ctx, *, D: int, S: int, G: int, block_size: int, rows_needed: int,
                          kv_itemsize: int) -> SgmatGeometry:
    """The subgroup-matrix geometry of a call (``sgmat_ineligible`` must have returned None)."""
    R, TK, BK, WG = _candidates(ctx, D, block_size, rows_needed)
    return SgmatGeometry(D=D, S=S, G=G, TK=TK, RMAX=R, WG=WG, TD=-(-D // 4), kv_itemsize=kv_itemsize, BK=BK,
                         NPW=PERSISTENT_WORKGROUPS)
