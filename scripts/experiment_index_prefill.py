"""Experiment: the prefill index branch on the device, kernel variants side by side (GPU timestamps).

Times the block scores and the top-k of ``AttentionPlan.run_sparse`` on the bench's prefill layer
workload (B = 1, L = 32k, the last 4096 queries, causal, Hkv = 4, d_idx = 128, float16 index
keys, top-16), as the ``layer`` suite's split does, for each variant in several interleaved
rounds (the GPU's speed drifts between runs; alternating the variants keeps that out of the
comparison). A variant is a set of kernel sources: the working tree's, or a ``--variant``
folder's WGSL files of the same names (a kernel the folder lacks is the working tree's). Every
variant's output must equal the first one's, bit for bit (the variants compared here are meant
to give the same bits); a line says when it does not. Run on a machine with Dawn:

    python scripts/experiment_index_prefill.py [--backend dawn] [--variant LABEL=DIR ...] [--rounds 4]
        [--ipw N ...] [--nt N ...] [--rows N ...] [--combo IPW,NT,ROWS ...]

``--ipw``, ``--nt`` and ``--rows`` add the working tree's kernels with one geometry constant of the
tensor-core block scores changed (items per workgroup, 16-position tiles per step, rows per work
item at most); ``--combo`` changes the three together.

``--workload decode`` times the decode layer workload's index branch instead (B = 32 sequences of
32k, one query each).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _wgsl_variants as wv
from _layer_inputs import add_arguments, layer_inputs

from paged_sparse_attn.backends.wgpu import _index_branch as ib
from paged_sparse_attn.backends.wgpu import _kernels
from paged_sparse_attn.bench.layer import _plan

KERNELS = ("SCORES_SGMAT", "TOPK")  # the module attributes of _index_branch a variant replaces
ORIGINAL = {k: getattr(ib, k) for k in KERNELS}


def register(tag: str, folder: Path | None) -> dict[str, str]:
    """Kernel names of a variant: the working tree's, or ``folder``'s files under names of their own."""
    names = {}
    for attr, base in ORIGINAL.items():
        if folder is None or not (folder / base).exists():
            names[attr] = base
            continue
        names[attr] = wv.register(f"x_{tag}_{base}", (folder / base).read_text(), _kernels.KERNEL_TABLE[base])
    return names


def measure(backend: str, names: dict[str, str], prob, iqs, ik, lw, calls: int, ipw: int | None = None,
            options: dict | None = None, nt: int | None = None, rows: int | None = None):
    """(median scores s, median top-k s, output of one call) of one variant, on a fresh device."""
    from paged_sparse_attn import registry

    for attr, name in names.items():
        setattr(ib, attr, name)
    orig_args, orig_ipw, orig_nt = ib.topk_pipeline_args, ib.SGMAT_SCORES_IPW, ib.SGMAT_SCORES_NT
    orig_rows = ib.SGMAT_SCORES_ROWS
    ib.SGMAT_SCORES_IPW = orig_ipw if ipw is None else ipw
    ib.SGMAT_SCORES_NT = orig_nt if nt is None else nt
    ib.SGMAT_SCORES_ROWS = orig_rows if rows is None else rows
    if "fn rank_rows" not in wv.SOURCES.get(names["TOPK"], "fn rank_rows"):  # a top-k from before that entry point
        ib.topk_pipeline_args = lambda ctx, keys, msb, rows: ("main", {**orig_args(ctx, keys, msb, rows)[1], "CAP": ib.topk_cap(ctx)})
    be = type(registry.get_backend(backend))(timestamps=True, **(options or {}))
    try:
        kd, vd = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
        ikd = be.upload_index_cache(ik)
        plan = _plan(be, lw, prob)
        sc, tk = [], []
        for i in range(calls + 1):
            plan.run_sparse(prob["q"], kd, vd, iqs[i % len(iqs)], ikd)  # (host q: the call reads its timings)
            t = be.last_timings
            if i:
                sc.append(t.get("gpu_scores_s", np.nan))  # (nan: a device without timestamps)
                tk.append(t.get("gpu_topk_s", np.nan))
        out = plan.run_sparse(prob["q"], kd, vd, iqs[0], ikd)
        plan.close()
        return float(np.median(sc)), float(np.median(tk)), np.asarray(out)
    finally:
        for k, v in ORIGINAL.items():
            setattr(ib, k, v)
        ib.topk_pipeline_args, ib.SGMAT_SCORES_IPW, ib.SGMAT_SCORES_NT = orig_args, orig_ipw, orig_nt
        ib.SGMAT_SCORES_ROWS = orig_rows
        be.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    wv.add_arguments(ap, rounds=4)
    ap.add_argument("--ipw", type=int, nargs="*", default=[],
                    help="also the working tree's kernels with these work items per workgroup (SGMAT_SCORES_IPW)")
    ap.add_argument("--nt", type=int, nargs="*", default=[],
                    help="also the working tree's kernels with these 16-position tiles per step (SGMAT_SCORES_NT)")
    ap.add_argument("--rows", type=int, nargs="*", default=[],
                    help="also the working tree's kernels with at most these rows per work item (SGMAT_SCORES_ROWS)")
    ap.add_argument("--combo", nargs="*", default=[],
                    help="also the working tree's kernels with IPW,NT,ROWS together (e.g. 8,1,128)")
    add_arguments(ap)
    a = ap.parse_args()
    t0 = time.perf_counter()
    lw, prob, iqs, ik = layer_inputs(a.workload, a.shape)
    variants = []
    for i, v in enumerate(a.variant):
        label, folder = v.split("=", 1)
        variants.append((label, register(f"v{i}", Path(folder)), None, None, None, None))
    variants.append(("working tree", register("tree", None), None, None, None, None))
    variants += [(f"working tree IPW={n}", register("tree", None), n, None, None, None) for n in a.ipw]
    variants += [(f"working tree NT={n}", register("tree", None), None, None, n, None) for n in a.nt]
    variants += [(f"working tree rows={n}", register("tree", None), None, None, None, n) for n in a.rows]
    for c in a.combo:
        i_, n_, r_ = (int(x) for x in c.split(","))
        variants.append((f"IPW={i_} NT={n_} rows={r_}", register("tree", None), i_, None, n_, r_))
    if a.no_robustness:
        variants.append(("no bounds checks", register("tree", None), None, {"robustness": False}, None, None))
    rows: dict[str, list] = {v[0]: [] for v in variants}
    first = None
    for r in range(a.rounds):
        for label, names, ipw, options, nt, nrows in variants:
            s, k, out = measure(a.backend, names, prob, iqs, ik, lw, a.calls, ipw, options, nt, nrows)
            same = "" if first is None else ("  same output" if np.array_equal(out, first, equal_nan=True)
                                             else "  OUTPUT DIFFERS")
            first = out if first is None else first
            rows[label].append((s, k))
            print(f"round {r}: {label:24s} scores {s * 1e3:7.3f} ms  top-k {k * 1e6:7.1f} us  index "
                  f"{(s + k) * 1e3:7.3f} ms{same}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("medians over the rounds:")
    for label, xs in rows.items():
        s = np.median([x[0] for x in xs])
        k = np.median([x[1] for x in xs])
        print(f"  {label:24s} scores {s * 1e3:7.3f} ms  top-k {k * 1e6:7.1f} us  index {(s + k) * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
