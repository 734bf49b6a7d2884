"""Experiment: the tensor-core prefill partials kernel (psa_partials_sgmat.wgsl) as it is against
other versions of it: the file at git revisions (``--rev``) or in folders (``--variant``).

Each version is registered under the kernel's own name for this process only and timed on the
bench's prefill layer workload (B = 1, L = 32k, the last 4096 queries, causal, top-16 of
128-token blocks, float16 caches) as the GPU time of a planned attention call's partials and
combine (timestamps), each version on a fresh device, in alternating rounds; every output is
compared bit for bit with every other version's (the largest difference when they differ). The
host picks the geometry as it does now, so a version must take the same override constants;
``--rows LABEL=R`` caps that version's rows per work item at R (a kernel from before items of
64 rows: ``--rev c74a2ef --rows 'at c74a2ef=32'``); ``--npw LABEL=N`` runs that version on N
workgroups that loop over the items (``NPW``), and ``N = 0`` one workgroup per item, without the
``NPW`` constant (a kernel from before persistent workgroups: ``--rev 66a91ec --npw 'at 66a91ec=0'``);
``--geometry LABEL=R:TK:NSG`` runs that version with R rows per item, TK keys per K/V tile and NSG
subgroups (the kernel's rules must hold: ``_sgmat._fits``), the positions per softmax lane as the
host picks them (``--geometry 'rows 48=48:64:12'``: a version labelled ``rows 48`` is the working
tree's kernel again, the host's pick is what differs).
Run on a machine with Dawn and f16 subgroup matrices:

    python scripts/experiment_partials_ab.py --rev e603a7a [--variant LABEL=DIR] [--rows LABEL=R] [--npw LABEL=N]
        [--geometry LABEL=R:TK:NSG] [--rounds 2] [--calls 4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li
from _wgsl_variants import one_item_per_workgroup, original, print_medians, register

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _kernels, _sgmat

BASE = "psa_partials_sgmat.wgsl"
ROOT = Path(__file__).resolve().parents[1]


def versions(revs: list[str], folders: list[str], name: str = BASE) -> dict[str, str]:
    """{label: WGSL} of kernel ``name``: the working tree's, then each revision's, then each folder's."""
    out = {"as it is": original(name)}
    for rev in revs:
        out[f"at {rev}"] = subprocess.run(["git", "show", f"{rev}:shaders/{name}"], cwd=ROOT, check=True,
                                          capture_output=True, text=True).stdout
    for spec in folders:
        label, _, folder = spec.partition("=")
        out[label] = (Path(folder) / name).read_text()
    return out


def _forced(ctx, D: int, block_size: int, R: int, TK: int, nsg: int):
    """``_sgmat._candidates``'s answer for the geometry R, TK, NSG (BK as the host rounds it);
    SystemExit where the kernel's rules or the device's workgroup memory refuse it."""
    WG = _sgmat.SUBGROUP * nsg
    sl = max(1, WG // R)
    need = max(-(-block_size // sl), -(-TK // sl))
    BK = sl * next((c for c in _sgmat.NK_CHOICES if c >= need), 2 * _sgmat.NK_CHOICES[-1])
    if BK % TK or not _sgmat._fits(D, R, TK, BK, nsg) or _sgmat.sgmat_workgroup_bytes(D, R, BK) > ctx.workgroup_storage:
        raise SystemExit(f"geometry R={R} TK={TK} NSG={nsg} (BK={BK}) does not fit the kernel or the device")
    return R, TK, BK, WG


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", action="append", default=[], help="a git revision whose kernel to time (repeatable)")
    ap.add_argument("--variant", action="append", default=[], help="LABEL=DIR: a folder holding the kernel file")
    ap.add_argument("--rows", action="append", default=[], help="LABEL=R: at most R rows per work item for that version")
    ap.add_argument("--npw", action="append", default=[],
                    help="LABEL=N: N persistent workgroups for that version (0: one per item, no NPW constant)")
    ap.add_argument("--geometry", action="append", default=[],
                    help="LABEL=R:TK:NSG: that version (the working tree's kernel unless --rev/--variant names "
                         "it) with R rows per item, TK keys per tile, NSG subgroups")
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--kernel", default=BASE,
                    help="the kernel file the versions replace (default: the partials; e.g. psa_merge.wgsl)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=4)
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs("prefill")
    srcs = versions(a.rev, a.variant, a.kernel)
    geos = {label: tuple(int(x) for x in g.split(":")) for label, _, g in (x.rpartition("=") for x in a.geometry)}
    for label in geos:
        srcs.setdefault(label, srcs["as it is"])
    row = _kernels.KERNEL_TABLE[a.kernel]
    res: dict = {}
    outs: dict = {}
    caps = {label: int(r) for label, _, r in (x.rpartition("=") for x in a.rows)}
    candidates = _sgmat._candidates
    npws = {label: int(n) for label, _, n in (x.rpartition("=") for x in a.npw)}
    npw0 = _sgmat.PERSISTENT_WORKGROUPS
    try:
        for r in range(a.rounds):
            for label, src in srcs.items():
                register(a.kernel, src, row)
                cap = caps.get(label)
                _sgmat._candidates = candidates if cap is None else (
                    lambda ctx, D, bs, rows, _c=cap: candidates(ctx, D, bs, min(rows, _c)))
                if label in geos:
                    _sgmat._candidates = lambda ctx, D, bs, rows, _g=geos[label]: _forced(ctx, D, bs, *_g)
                npw = npws.get(label, npw0)
                _sgmat.PERSISTENT_WORKGROUPS = npw or npw0
                one_item_per_workgroup(not npw)
                be = type(registry.get_backend(a.backend))(timestamps=True)
                try:
                    t, out, geo = li.attention_gpu_time(be, lw, prob, a.calls)
                    res.setdefault(label, []).append(t)
                    outs.setdefault(label, out)
                    cmp = []
                    for other, o in outs.items():
                        if other != label:
                            same = np.array_equal(out, o, equal_nan=True)
                            cmp.append(f"{other}: " + ("same bits" if same else
                                                       f"max diff {float(np.nanmax(np.abs(out - o))):.3g}"))
                    print(f"round {r}: {label:24s} {t * 1e3:7.3f} ms  (kernel {geo.get('kernel')})"
                          f"  {'; '.join(cmp)}", flush=True)
                finally:
                    be.close()
    finally:
        register(a.kernel, srcs["as it is"], row)
        _sgmat._candidates = candidates
        _sgmat.PERSISTENT_WORKGROUPS = npw0
        one_item_per_workgroup(False)
    print_medians(res, 24)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
