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
MAX_NG = 16          # private accumulator arrays of the kernel hold 16 heads
DECODE_WG = 64  # invocations per workgroup (one per key of a tile): the fastest of 64..1024 on the H200
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DecodeGeometry(Geometry):
    """Geometry of the decode kernel: ``RMAX`` = NG heads per item, ``TK`` keys per tile,
    ``RB`` accumulator slots of the final cross-group reduction."""

    RB: int = 1
    kernel: str = DECODE

    @property
    def workgroup_bytes(self) -> int:
        return decode_workgroup_bytes(self.D, self.TK, self.RMAX, self.WG, self.RB)

    def constants(self) -> dict[str, int]:
        return {"D": self.D, "S": self.S, "TK": self.TK, "NG": self.RMAX, "WG": self.WG, "TD": self.TD,
                "RB": self.RB}


def decode_workgroup_bytes(D: int, TK: int, NG: int, WG: int, RB: int) -> int:
    """Workgroup memory of psa_partials_decode.wgsl for these constants (arrays rounded to 16 B)."""
    TD = -(-D // 4)
    TD4 = (TD + 3) // 4 * 4
    TKP = TK + 1 - (TK & 1)

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    return (a(NG * TD4 * 16) + a(NG * TKP * 4) + a(TK * 4) + 3 * a(WG * 4) + a(NG * 4)
            + a(RB * NG * TD * 16))


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


def choose_decode_geometry(*, D: int, S: int, G: int, block_size: int, kv_itemsize: int, wg_storage: int,
                           wg_limit: int, wg_size: int | None = None) -> DecodeGeometry:
    """Largest decode geometry that fits the workgroup memory (wgpu does not check it).

    NG is G rounded up to a power of two, at most 16 (larger G is split into items of 16 heads by
    the planner); TK is one key per invocation, at most the block. Shrunk in order: reduction
    slots RB, then TK (down to 32), then NG, then TK.
    """
    wg = min(wg_size or DECODE_WG, wg_limit)
    wg = 1 << (wg.bit_length() - 1)  # a power of two: NG divides it
    TD = -(-D // 4)
    if TD > wg:
        raise UnsupportedError(f"backend 'wgpu': head_dim {D} needs a workgroup size >= {TD} [R18]")
    ng = min(MAX_NG, 1 << max(0, G - 1).bit_length(), wg)
    tk = max(1, min(wg, block_size))
    kg = wg // TD
    rb = max(1, kg - 1)

    def size() -> int:
        return decode_workgroup_bytes(D, tk, ng, wg, rb)

    while size() > wg_storage:
        if rb > 1:
            rb = (rb + 1) // 2
        elif tk > 32:
            tk = (tk + 1) // 2
        elif ng > 1:
            ng //= 2
        elif tk > 1:
            tk = (tk + 1) // 2
        else:
            raise UnsupportedError(
                f"backend 'wgpu': the decode kernel for head_dim {D} needs {size()} bytes of workgroup "
                f"memory, the device allows {wg_storage} [R18]")
    return DecodeGeometry(D=D, S=S, G=G, TK=tk, RMAX=ng, WG=wg, TD=TD, kv_itemsize=kv_itemsize, RB=rb)
