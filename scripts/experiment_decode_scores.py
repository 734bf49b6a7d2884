"""Decode block-score kernel variants (``psa_block_scores_decode_sg.wgsl``) on the MSA decode layer.

Usage: ``python scripts/experiment_decode_scores.py [--backends dawn wgpu] [--repeat 10] [--rounds 2] [--quick]``

For the bench's decode layer workload (B = 32, L = 32k, Hkv = 4, index dim 128, float16 index
keys: 268 MB read per layer) it times, per backend and variant, the block-score pass of
``AttentionPlan.run_sparse`` (GPU timestamps, its own pass), the layer's GPU time, and a
pipelined loop of 32 whole layers (wall and host microseconds per layer); variants alternate over
``--rounds`` rounds on the same two devices per backend (one with timestamps, one without), each
variant with its own pipelines and plans. Every variant's layer output must equal the as-is
kernel's bit for bit (the same sums in the same order), which the script checks.

Variants (text edits of the kernel; timing only, each is exact only where stated):

* ``pages hoisted``: an item's pages (at most 4: BS <= 4 S, read only below npos) loaded once into
  registers before its queries, so a key load no longer waits for a page-table load;
* ``merged into cleared scores``: the layer as it was before the ONCE store (the scores cleared,
  each item's maxima merged into them with a read of ``out``);
* 128 invocations per workgroup, or the next chunk's loads in flight.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li
from experiment_decode import _with_edits

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _index_branch as ib
from paged_sparse_attn.backends.wgpu import _kernels, _layer
from paged_sparse_attn.bench.layer import _plan

SG = ib.SCORES_DECODE_SG
HOIST = [
    ("fn key_unit(pg: u32, p: u32, npos: u32, r: u32, ok: ptr<function, bool>) -> vec4<u32> {",
     ("var<private> item_pages: vec4<u32>;  // the item's pages (BS <= 4 S)\n\n"
      "fn page_of(pg: u32, p: u32) -> u32 {\n"
      "    if (BS <= 4u * S) {\n        return item_pages[min(p / S, 3u)];\n    }\n"
      "    return pages[pg + p / S];\n}\n\n"
      "fn key_unit(pg: u32, p: u32, npos: u32, r: u32, ok: ptr<function, bool>) -> vec4<u32> {")),
    ("        let slab = pages[pg + p / S];  // INVALID is >= every chunk_end",
     "        let slab = page_of(pg, p);  // INVALID is >= every chunk_end"),
    ("    let r = lid % R;             // lane in the key group",
     ("    if (BS <= 4u * S) {\n        let np = (npos + S - 1u) / S;\n"
      "        for (var i = 0u; i < 4u; i++) {\n            if (i < np) {\n"
      "                item_pages[i] = pages[pg + i];\n            }\n        }\n    }\n"
      "    let r = lid % R;             // lane in the key group")),
]
VARIANTS = {  # name: (edits, workgroup size, next chunk in flight, ONCE store)
    "as is": ([], None, None, True),
    "merged into cleared scores": ([], None, None, False),
    "pages hoisted": (HOIST, None, None, True),
    "WG 128": ([], 128, None, True),
    "PF 1": ([], None, 1, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="*", default=["dawn", "wgpu"])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="a small decode problem (a smoke run on a CPU driver)")
    a = ap.parse_args()
    lw, prob, iqs, ik = li.layer_inputs("decode", (1, 4096) if a.quick else None)
    key_bytes = int(prob["used_kv_lens"].sum()) * lw.index_dim * np.dtype(lw.w.dtype).itemsize
    print(f"decode layer: B={lw.w.B} L={lw.w.L} index keys read {key_bytes / 1e6:.0f} MB per layer", flush=True)
    default = (ib.SCORES_DECODE_SG_WG, ib.SCORES_DECODE_SG_PF)
    ref: dict = {}
    res: dict = {}
    t_all = time.perf_counter()
    n = 2 if a.quick else 32
    hq = [np.random.default_rng(5 + i).standard_normal(prob["q"].shape, dtype=np.float32) for i in range(2)]
    devs = {}
    for name in a.backends:  # per backend one device with timestamps, one without (the loop's)
        cls = type(registry.get_backend(name))
        devs[name] = [li.on_device(cls(timestamps=True), lw, prob, iqs, ik, layers=8),
                      li.on_device(cls(), lw, prob, iqs, ik, layers=n)]
    for rnd in range(a.rounds):
        for name in a.backends:
            dt, dl = devs[name]
            for vname in a.variants:
                edits, wg, pf, once = VARIANTS[vname]
                _layer.SCORES_ONCE = once
                orig, src = _with_edits(edits, SG)
                _kernels.shader_source = src
                ib.SCORES_DECODE_SG_WG = wg or default[0]
                ib.SCORES_DECODE_SG_PF = default[1] if pf is None else pf
                try:
                    for d in (dt, dl):  # this variant's pipelines and plans, on the same devices
                        ctx = d.be._device()
                        for key in [x for x in ctx.pipelines if x[0] == SG]:
                            del ctx.pipelines[key]
                        d.plan.close()
                        d.plan = _plan(d.be, lw, prob)
                    sc, tot = [], []
                    for i in range(a.repeat + 2):
                        # host queries: a call that reads its results back reports its passes' times
                        out = dt.plan.run_sparse(hq[i % 2], dt.k, dt.v, iqs[i % 2], dt.ik)
                        t = dt.be.last_timings
                        if i >= 2:
                            sc.append(t.get("gpu_scores_s", np.nan))
                            tot.append(t.get("gpu_total_s", np.nan))
                    o = np.asarray(out[0] if isinstance(out, tuple) else out)
                    same = ref.setdefault(name, o) is o or np.array_equal(ref[name], o)
                    # the pipelined loop without timestamps (what a model runs)
                    loop = li.timed_loops({"layer": li.decode_calls(dl)["layer"]}, dl.be.synchronize, 4, n)["layer"]
                    row = (np.median(sc) * 1e6, np.median(tot) * 1e6, *np.median(loop, axis=0))
                    res.setdefault((name, vname), []).append(row)
                    print(f"  round {rnd} {name:5s} {vname:26s} scores {row[0]:7.1f} us "
                          f"({key_bytes / row[0] / 1e6:.2f} TB/s)  layer GPU {row[1]:7.1f}  loop wall {row[2]:7.1f} "
                          f"host {row[3]:7.1f} us/layer  same output: {same}", flush=True)
                    if not same:
                        print("    DIFFERENT OUTPUT", flush=True)
                finally:
                    _kernels.shader_source = orig
                    ib.SCORES_DECODE_SG_WG, ib.SCORES_DECODE_SG_PF = default
                    _layer.SCORES_ONCE = True
    print("\nmedian over rounds (scores us, layer GPU us, loop wall us, loop host us)")
    for (name, vname), rows in res.items():
        m = np.median(np.array(rows), axis=0)
        print(f"  {name:5s} {vname:26s} {m[0]:7.1f} {m[1]:7.1f} {m[2]:7.1f} {m[3]:7.1f}")
    print(f"done in {time.perf_counter() - t_all:.1f} s")


if __name__ == "__main__":
    main()
