"""Experiment: kernel variants of a whole planned MSA layer, every pass timed (GPU timestamps).

Runs ``AttentionPlan.run_sparse`` on the ``layer`` suite's prefill or decode workload (block
scores, top-k, inversion, partials and combine in one submission) and reports the GPU time of
each pass, for each variant in several interleaved rounds (the GPU's speed drifts between runs;
alternating the variants keeps that out of the comparison). A variant is a folder of WGSL files:
each file replaces the project's kernel of the same name (``shaders/<name>``) for that variant,
the other kernels stay the working tree's. Each variant runs on a fresh device (no pipeline is
shared). Every variant's output must equal the first one's bit for bit (the variants compared
here are meant to give the same bits); a line says when it does not. Run on a machine with Dawn::

    python scripts/experiment_layer_passes.py [--backend dawn] [--workload prefill|decode]
        [--variant LABEL=DIR ...] [--no-robustness] [--rounds 3]

``--geometry LABEL=R,TK,NSG`` adds the working tree's kernels with that geometry of the tensor-core
partials kernel (rows per item, keys per K/V tile, subgroups per workgroup; the host's rules for
it still apply). ``--shape TQ L`` shrinks the prefill workload (to try the script on a CPU driver).
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

from paged_sparse_attn.backends.wgpu import _sgmat
from paged_sparse_attn.bench.layer import _plan

PASSES = ("gpu_scores_s", "gpu_topk_s", "gpu_invert_s", "gpu_attention_s", "gpu_total_s")


def geometry(spec: str):
    """A replacement of ``_sgmat._candidates`` that picks rows, K/V tile and subgroups ``R,TK,NSG``."""
    R, TK, nsg = (int(x) for x in spec.split(","))

    def pick(ctx, D, block_size, rows_needed):
        BK = -(-block_size // TK) * TK
        WG = _sgmat.SUBGROUP * nsg
        if not _sgmat._fits(D, R, TK, BK, nsg) or _sgmat.sgmat_workgroup_bytes(D, R, BK) > ctx.workgroup_storage:
            raise SystemExit(f"--geometry {spec}: does not fit the kernel's rules or the device")
        return R, TK, BK, WG
    return pick


ORIGINAL_CANDIDATES = _sgmat._candidates


def measure(backend: str, sources: dict[str, str], prob, iqs, ik, lw, calls: int, options: dict | None):
    """({pass: median GPU seconds}, output of one call) of one variant, on a fresh device."""
    from paged_sparse_attn import registry

    options = dict(options or {})
    _sgmat._candidates = geometry(options.pop("geometry")) if "geometry" in options else ORIGINAL_CANDIDATES
    wv.use(sources)
    be = type(registry.get_backend(backend))(timestamps=True, **(options or {}))
    try:
        kd, vd = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
        ikd = be.upload_index_cache(ik)
        plan = _plan(be, lw, prob)
        times: dict[str, list] = {k: [] for k in PASSES}
        for i in range(calls + 1):
            plan.run_sparse(prob["q"], kd, vd, iqs[i % len(iqs)], ikd)  # (host q: the call reads its timings)
            if i:
                for k in PASSES:
                    times[k].append(be.last_timings.get(k, np.nan))  # (nan: a device without timestamps)
        out = plan.run_sparse(prob["q"], kd, vd, iqs[0], ikd)
        plan.close()
        return {k: float(np.median(v)) for k, v in times.items()}, np.asarray(out)
    finally:
        wv.use({})
        _sgmat._candidates = ORIGINAL_CANDIDATES
        be.close()


def line(t: dict) -> str:
    return (f"scores {t['gpu_scores_s'] * 1e6:8.1f}  top-k {t['gpu_topk_s'] * 1e6:6.1f}  "
            f"invert {t['gpu_invert_s'] * 1e6:6.1f}  attention {t['gpu_attention_s'] * 1e6:8.1f}  "
            f"total {t['gpu_total_s'] * 1e6:8.1f} us")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    wv.add_arguments(ap, rounds=3)
    ap.add_argument("--geometry", action="append", default=[],
                    help="LABEL=R,TK,NSG: the tensor-core partials kernel in that geometry (repeatable)")
    add_arguments(ap)
    a = ap.parse_args()
    t0 = time.perf_counter()
    lw, prob, iqs, ik = layer_inputs(a.workload, a.shape)
    variants = [("working tree", {}, None)]
    for v in a.variant:
        label, folder = v.split("=", 1)
        files = sorted(Path(folder).glob("*.wgsl"))
        if not files:
            raise SystemExit(f"--variant {v}: no .wgsl file in {folder}")
        variants.append((label, {f.name: f.read_text() for f in files}, None))
    for g in a.geometry:
        label, spec = g.split("=", 1)
        variants.append((label, {}, {"geometry": spec}))
    if a.no_robustness:
        variants.append(("no bounds checks", {}, {"robustness": False}))
    rows: dict[str, list] = {v[0]: [] for v in variants}
    first = None
    for r in range(a.rounds):
        for label, sources, options in variants:
            t, out = measure(a.backend, sources, prob, iqs, ik, lw, a.calls, options)
            same = "" if first is None else ("  same output" if np.array_equal(out, first, equal_nan=True)
                                             else "  OUTPUT DIFFERS")
            first = out if first is None else first
            rows[label].append(t)
            print(f"round {r}: {label:22s} {line(t)}{same}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"medians over the rounds ({a.workload}, {a.backend}):")
    for label, ts in rows.items():
        print(f"  {label:22s} {line({k: float(np.median([t[k] for t in ts])) for k in PASSES})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
