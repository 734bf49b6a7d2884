"""Geometry of the decode partials kernel (``psa_partials_decode.wgsl``) and when it applies.

The decode kernel reads the same plan as the generic kernel (``_plan``): its geometry is a
:class:`~._plan.Geometry` whose ``RMAX`` is the number of heads per work item (``NG``), so the
planner's head splits and item records are reused unchanged. It applies when every slot group
of the call has exactly one edge (one query reads each selected block: decode), the head dim is
at most 256 and the workgroup memory fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedError
from ._plan import Geometry

__all__ = ["DECODE", "GENERIC", "KERNELS", "DecodeGeometry", "decode_workgroup_bytes", "choose_decode_geometry",
           "decode_ineligible"]

GENERIC = "psa_partials.wgsl"
DECODE = "psa_partials_decode.wgsl"
KERNELS = {"generic": GENERIC, "decode": DECODE}
MAX_NG = 8           # the kernel keeps 8 head slots in two vec4 registers (larger G: items of 8)
DECODE_WG = 128      # invocations per workgroup: the fastest of 64, 128, 256 on the H200 (halved while the workgroup memory does not fit)
DECODE_DS = 2        # head-dim slices per key in the score phase (TK = WG / 2): the fastest of 1, 2, 4, 8
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DecodeGeometry(Geometry):
    """Geometry of the decode kernel: ``RMAX`` = NG heads per item (<= 8), ``TK`` keys per tile
    (a power of two dividing ``WG``)."""

    kernel: str = DECODE

    @property
    def workgroup_bytes(self) -> int:
        return decode_workgroup_bytes(self.D, self.TK, self.RMAX, self.WG)

    def constants(self) -> dict[str, int]:
        return {"D": self.D, "S": self.S, "TK": self.TK, "NG": self.RMAX, "WG": self.WG, "TD": self.TD}


def decode_workgroup_bytes(D: int, TK: int, NG: int, WG: int) -> int:
    """Workgroup memory of psa_partials_decode.wgsl for these constants (arrays rounded to 16 B)."""
    TD = -(-D // 4)
    QH = 4 * (-(-NG // 4))

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    return a(QH * TD * 16) + a(2 * WG * 16) + a(2 * TK * 4) + 3 * a(WG * 4) + a(8 * 4)


def decode_ineligible(*, D: int, max_slot_edges: int, wg_limit: int) -> str | None:
    """Why the decode kernel cannot run this call, or None."""
    if max_slot_edges > 1:
        return (f"a selected block is read by {max_slot_edges} queries of one sequence (the decode kernel "
                "needs exactly one query per (KV head, block): one query per sequence)")
    if D > MAX_HEAD_DIM:
        return f"head_dim {D} > {MAX_HEAD_DIM}"
    if wg_limit < 64:
        return f"the device allows {wg_limit} invocations per workgroup (< 64)"
    return None


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def choose_decode_geometry(*, D: int, S: int, G: int, block_size: int, kv_itemsize: int, wg_storage: int,
                           wg_limit: int, wg_size: int | None = None, tile: int | None = None) -> DecodeGeometry:
    """Decode geometry that fits the workgroup memory (wgpu does not check it).

    NG is G, at most 8 (larger G is split into items of at most 8 heads by the planner). The
    workgroup size is a power of two, at least ceil(D / 4) and 8, at most ``wg_size`` (default
    128), halved until the workgroup memory fits; TK (keys per tile) is the block rounded up to a
    power of two, at most half the workgroup size (``DECODE_DS`` invocations per key in the score
    phase), or ``tile`` when given.
    """
    TD = -(-D // 4)
    floor = _pow2_at_least(max(8, TD))
    wg = min(wg_size or DECODE_WG, wg_limit)
    wg = max(1 << (wg.bit_length() - 1), floor)  # a power of two: TK divides it
    if wg > wg_limit:
        raise UnsupportedError(f"backend 'wgpu': head_dim {D} needs a workgroup size >= {wg}, the device "
                               f"allows {wg_limit} [R18]")
    ng = min(MAX_NG, G)

    def tk_for(w: int) -> int:
        cap = _pow2_at_least(tile) if tile else max(1, w // DECODE_DS)
        return max(1, min(w, _pow2_at_least(block_size), cap))

    while decode_workgroup_bytes(D, tk_for(wg), ng, wg) > wg_storage:
        if wg // 2 < floor:
            raise UnsupportedError(
                f"backend 'wgpu': the decode kernel for head_dim {D} needs "
                f"{decode_workgroup_bytes(D, tk_for(wg), ng, wg)} bytes of workgroup memory, the device "
                f"allows {wg_storage} [R18]")
        wg //= 2
    return DecodeGeometry(D=D, S=S, G=G, TK=tk_for(wg), RMAX=ng, WG=wg, TD=TD, kv_itemsize=kv_itemsize)
