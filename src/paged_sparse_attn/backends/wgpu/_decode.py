"""Geometry of the decode partials kernel (``psa_partials_decode.wgsl``) and when it applies.

The decode kernel reads the same plan as the generic kernel (``_plan``): its geometry is a
:class:`~._plan.Geometry` whose ``RMAX`` is the number of heads per work item (``NG``), so the
planner's head splits and item records are reused unchanged. It applies when every slot group
of the call has exactly one edge (one query reads each selected block: decode), a cache row is
whole 16-byte units (the kernel binds the caches as ``vec4<u32>``), the device has subgroups of
one measured size, and a row's units fit one key group of ``R <= subgroup size`` lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedError
from ._plan import Geometry

__all__ = ["DECODE", "GENERIC", "KERNELS", "DecodeGeometry", "decode_workgroup_bytes", "choose_decode_geometry",
           "decode_ineligible", "decode_lanes"]

GENERIC = "psa_partials.wgsl"
DECODE = "psa_partials_decode.wgsl"
KERNELS = {"generic": GENERIC, "decode": DECODE, "sgmat": "psa_partials_sgmat.wgsl"}  # partials_kernel= choices
MAX_NG = 8           # the kernel keeps 8 head slots in registers (larger G: items of 8 heads)
CHUNK = 4            # keys per chunk of a key group (the kernel's loads in flight per lane)
MIN_LANES = 8        # a key group reduce-scatters 8 head slots: at least 8 lanes
# the next chunk's loads in flight during a chunk (PF = 1), by cache itemsize: on the H200 it made
# float16 faster (74 against 84 us) and float32 slower (92-98 against 85 us: more registers per
# lane, fewer resident warps)
DECODE_PREFETCH = {2: 1, 4: 0}
MAX_HEAD_DIM = 256


def decode_lanes(D: int, kv_itemsize: int) -> tuple[int, int]:
    """(TE, R): 16-byte units of a cache row and lanes per key group (a power of two >= TE, >= 8)."""
    TE = 4 * (-(-D // 4)) * kv_itemsize // 16
    return TE, max(MIN_LANES, _pow2_at_least(TE))


@dataclass(frozen=True)
class DecodeGeometry(Geometry):
    """Geometry of the decode kernel: ``RMAX`` = NG heads per item (<= 8), ``R`` lanes per key
    group, ``WG // R`` key groups per workgroup, ``TK`` keys per chunk of a group."""

    kernel: str = DECODE
    R: int = 16
    SG: int = 32
    PF: int = 1

    @property
    def EU(self) -> int:
        return 16 // self.kv_itemsize

    @property
    def TE(self) -> int:
        return 4 * self.TD // self.EU

    @property
    def groups(self) -> int:
        return self.WG // self.R

    @property
    def workgroup_bytes(self) -> int:
        return decode_workgroup_bytes(self.D, self.WG, self.SG)

    def constants(self) -> dict[str, int]:
        return {"D": self.D, "S": self.S, "NG": self.RMAX, "WG": self.WG, "TD": self.TD, "EU": self.EU,
                "R": self.R, "SG": self.SG, "PF": self.PF}


def decode_workgroup_bytes(D: int, WG: int, SG: int) -> int:
    """Workgroup memory of psa_partials_decode.wgsl for these constants (arrays rounded to 16 B):
    the merge of its ``WG / min(SG, WG)`` subgroups (none for one)."""
    TD = -(-D // 4)
    nsg = WG // min(SG, WG)

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    return 2 * a(8 * nsg * 4) + a(max(1, (nsg - 1) * 8 * TD) * 16)


def decode_ineligible(*, D: int, max_slot_edges: int, wg_limit: int, kv_itemsize: int = 4,
                      subgroup: tuple[int | None, str] = (None, "no subgroup size measured")) -> str | None:
    """Why the decode kernel cannot run this call, or None. ``subgroup``: (size, why not)."""
    if max_slot_edges > 1:
        return (f"a selected block is read by {max_slot_edges} queries of one sequence (the decode kernel "
                "needs exactly one query per (KV head, block): one query per sequence)")
    if D > MAX_HEAD_DIM:
        return f"head_dim {D} > {MAX_HEAD_DIM}"
    row_bytes = 4 * (-(-D // 4)) * kv_itemsize
    if row_bytes % 16:
        return (f"a cache row of head_dim {D} padded to whole vec4s is {row_bytes} bytes, not whole 16-byte "
                "units")
    size, why = subgroup
    if size is None:
        return why
    TE, R = decode_lanes(D, kv_itemsize)
    if size < R:
        return (f"a cache row of head_dim {D} is {TE} 16-byte units, read by a key group of {R} lanes; the "
                f"device's subgroup size is {size}")
    if wg_limit < size:
        return f"the device allows {wg_limit} invocations per workgroup (< its subgroup size {size})"
    return None


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def choose_decode_geometry(*, D: int, S: int, G: int, kv_itemsize: int, wg_storage: int,
                           wg_limit: int, subgroup_size: int, wg_size: int | None = None,
                           prefetch: bool | None = None) -> DecodeGeometry:
    """Decode geometry that fits the workgroup memory (wgpu does not check it).

    NG is G, at most 8 (larger G is split into items of at most 8 heads by the planner). R is
    the lanes per key group (:func:`decode_lanes`). The workgroup size is a power of two, a
    multiple of the subgroup size and of R: ``wg_size`` rounded so (default: one subgroup, or R
    lanes if more; on the H200 32 invocations were the fastest of 32, 64 and 128 for both
    dtypes), halved while the merge buffer of its subgroups does not fit the workgroup memory. ``prefetch`` (default ``DECODE_PREFETCH`` by itemsize): the
    next chunk's loads in flight during a chunk.
    """
    TD = -(-D // 4)
    _, R = decode_lanes(D, kv_itemsize)
    pf = int(DECODE_PREFETCH.get(kv_itemsize, 1) if prefetch is None else bool(prefetch))
    floor = max(R, _pow2_at_least(subgroup_size))
    wg = _pow2_at_least(max(wg_size or floor, floor))
    if wg > wg_limit:
        wg = floor
    if wg > wg_limit:
        raise UnsupportedError(f"backend 'wgpu': the decode kernel needs a workgroup of {wg} invocations, the "
                               f"device allows {wg_limit} [R18]")
    while decode_workgroup_bytes(D, wg, subgroup_size) > wg_storage:
        if wg // 2 < floor:
            raise UnsupportedError(
                f"backend 'wgpu': the decode kernel for head_dim {D} needs "
                f"{decode_workgroup_bytes(D, wg, subgroup_size)} bytes of workgroup memory, the device allows "
                f"{wg_storage} [R18]")
        wg //= 2
    return DecodeGeometry(D=D, S=S, G=G, TK=CHUNK, RMAX=min(MAX_NG, G), WG=wg, TD=TD, kv_itemsize=kv_itemsize,
                          R=R, SG=int(subgroup_size), PF=pf)
