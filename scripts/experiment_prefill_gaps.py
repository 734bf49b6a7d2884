"""What a pipelined prefill attention layer spends around its kernels (wall time per layer).

Usage: ``python scripts/experiment_prefill_gaps.py [--backend dawn] [--repeat 5] [--shape TQ L]``.
For the prefill layer workload of the bench (B = 1, L = 32k, the last 4096 queries, causal,
top-16 of 128-token blocks, float16 caches, 8 layers with their own queries, device arrays, one
synchronisation per loop that waits and copies nothing, as the bench's ``layer`` suite; the loop's
output is read only after the timing, to compare bits) it times ``AttentionPlan.run`` as it is and with dispatches left out
(``DeviceRuntime._dispatch`` and the compute pass's indirect dispatch, the partials', skipped):

* ``inversion once``: the inversion's dispatches run on the loop's first call only; every layer
  has the same selection, so the items it left behind are the ones each layer needs and the
  results stay valid (compared with "as is": the same bits, or the script says so);
* ``no combine``, ``partials only``, ``inversion only``, ``no dispatch`` (the clears, the copies,
  empty passes and the submissions): timing only, their results are not valid.

The kernels' GPU time per layer (``gpu_invert_s`` and ``gpu_attention_s`` of a timed call with a
host ``q``, on a backend with ``timestamps=True``) against each loop's wall time per layer is what
a layer spends beyond its kernels; the differences between the variants say where.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _layer
from paged_sparse_attn.bench.layer import _loop_time

VARIANTS = ("as is", "inversion once", "no combine", "partials only", "inversion only", "no dispatch")


def _skipped(rt, pipe, name: str) -> bool:
    """Whether variant ``name`` leaves out the dispatch of ``pipe`` on plan runtime ``rt``."""
    inversion = any(pipe is p[0] for p in (*rt.p_inv.values(), *rt.p_scan.values()))
    if name == "inversion once":
        return inversion and getattr(rt, "_gaps_inverted", False)
    if name == "no combine":
        return pipe is rt.p_merge[0]
    if name == "inversion only":  # (the partials as well: a direct dispatch where they loop over items)
        return pipe is rt.p_merge[0] or pipe is rt.p_part[0]
    if name == "partials only":
        return inversion or pipe is rt.p_merge[0]
    return name == "no dispatch"


def _variant(name: str, pass_class) -> callable:
    """Patch ``_layer.DeviceRuntime._dispatch`` (and ``pass_class``'s indirect dispatch where the
    variant drops the partials) for variant ``name``; returns the undo."""
    cls = _layer.DeviceRuntime
    orig, orig_ind = cls._dispatch, pass_class.dispatch_workgroups_indirect

    def dispatch(self, cp, pipe, bgroup, grid):
        if not _skipped(self, pipe, name):
            orig(self, cp, pipe, bgroup, grid)

    if name != "as is":
        cls._dispatch = dispatch
    if name in ("inversion only", "no dispatch"):
        pass_class.dispatch_workgroups_indirect = lambda self, *a, **kw: None

    def undo():
        cls._dispatch = orig
        pass_class.dispatch_workgroups_indirect = orig_ind

    return undo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--repeat", type=int, default=5)
    li.add_shape_argument(ap)
    a = ap.parse_args()
    t_all = time.perf_counter()
    lw, prob, _, _ = li.layer_inputs("prefill", a.shape)
    kind = type(registry.get_backend(a.backend))
    be = kind(timestamps=True)
    d = li.on_device(be, lw, prob, layers=1)
    for _ in range(2):  # (a host q: the call reads its timestamps)
        d.plan.run(prob["q"], d.k, d.v, prob["selected"])
    gpu = be.last_timings
    inv, att = gpu.get("gpu_invert_s", np.nan), gpu.get("gpu_attention_s", np.nan)
    print(f"== {a.backend}: kernels per layer (GPU timestamps): inversion {inv * 1e3:.3f} ms, partials and "
          f"combine {att * 1e3:.3f} ms, both {(inv + att) * 1e3:.3f} ms", flush=True)
    be.close()
    be = kind()  # (no timestamps in the loops: a timed call waits for its own)
    d = li.on_device(be, lw, prob, layers=lw.layers)
    rt = d.plan._runtime
    enc = rt.ctx.device.create_command_encoder()
    cp = enc.begin_compute_pass()
    pass_class = type(cp)
    cp.end()
    ref = None
    for rnd in range(2):  # two rounds: run-order effects show as differences between them
        for vname in VARIANTS:
            undo = _variant(vname, pass_class)
            try:
                rt._gaps_inverted = False
                d.plan.run(d.q[0], d.k, d.v, d.sel).numpy()  # (its inversion runs in every variant but two)
                rt._gaps_inverted = True
                issued: list = []
                t = _loop_time(lambda i: d.plan.run(d.q[i], d.k, d.v, d.sel), lambda r: be.synchronize(), lw.layers,
                               a.repeat, False, issued)
                last = d.plan.run(d.q[0], d.k, d.v, d.sel).numpy()
                note = ""
                if vname == "as is":
                    ref = last
                elif vname == "inversion once":
                    note = "  same bits as 'as is'" if np.array_equal(last, ref, equal_nan=True) else "  DIFFERENT BITS"
                print(f"  round {rnd}: {vname:16s} {t * 1e3:8.3f} ms per layer (host {issued[0] * 1e3:6.3f}){note}",
                      flush=True)
            finally:
                undo()
    be.close()
    print(f"done in {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
