"""What a pipelined decode attention layer spends around its kernels (wall time per layer).

Usage: ``python scripts/experiment_layer_gaps.py [--backends wgpu dawn] [--repeat 7] [--quick]``.
For the decode layer workload of the bench (B=32, L=32k, Hq=32, Hkv=4, D=128, top-16, f16, 32
layers with their own queries, device arrays, one synchronisation per loop) it times
``AttentionPlan.run`` as it is and with parts of its encoding left out, for timing only (the
results of those variants are not valid):

* without the error words' clear before the pass and their copy into the result after it;
* without the combine dispatch; without the inversion dispatch; with the partials alone;
* with no dispatch at all (the clear, an empty pass, the copy and the submission).

The differences to "as is" are what each part adds to a layer in a model's loop.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _layer
from paged_sparse_attn.bench.layer import (
    LAYER_WORKLOADS,
    QUICK_LAYER_WORKLOADS,
    _loop_time,
    _plan,
)
from paged_sparse_attn.bench.workloads import make_problem


class _Encoder:
    """A command encoder that drops the 8-byte copies (the error words into the result)."""

    def __init__(self, enc):
        self._enc = enc

    def copy_buffer_to_buffer(self, src, so, dst, do, n):
        if n != 8:
            self._enc.copy_buffer_to_buffer(src, so, dst, do, n)

    def __getattr__(self, name):
        return getattr(self._enc, name)


def _variant(name):
    """Patch ``_layer.DeviceRuntime`` for a variant; returns the undo."""
    cls = _layer.DeviceRuntime
    orig_direct, orig_run = cls._encode_direct, cls._run_locked
    keep = {"no combine": ("direct", "part"), "no inversion": ("part", "merge"), "partials only": ("part",),
            "no dispatch": ()}.get(name)

    def direct(self, enc, qb, k, v, bg_slots, cp=None, bg_merge=None):
        if name == "no error words":
            cp = enc.begin_compute_pass()
            return orig_direct(self, enc, qb, k, v, bg_slots, cp, bg_merge)
        enc.clear_buffer(self.args, 48, 16)
        cp = enc.begin_compute_pass()
        if "direct" in keep:
            self._dispatch(cp, self.p_inv["direct"][0], bg_slots, self.grids["edges"])
        if "part" in keep:
            self._dispatch(cp, self.p_part[0], self._partials_group(qb, k, v, self.pparams_direct), self.direct_grid)
        if "merge" in keep:
            self._dispatch(cp, self.p_merge[0], bg_merge or self.bg_merge, self.grids["merge"])
        cp.end()

    def run(self, fn, q, k, v, sel, sparse=None):
        if name != "no error words":
            return orig_run(self, fn, q, k, v, sel, sparse)
        dev = self.ctx.device
        make = dev.create_command_encoder
        dev.create_command_encoder = lambda **kw: _Encoder(make(**kw))
        try:
            return orig_run(self, fn, q, k, v, sel, sparse)
        finally:
            del dev.create_command_encoder

    if name != "as is":
        cls._encode_direct = direct
        cls._run_locked = run

    def undo():
        cls._encode_direct, cls._run_locked = orig_direct, orig_run

    return undo


VARIANTS = ("as is", "no error words", "no combine", "no inversion", "partials only", "no dispatch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="*", default=None)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="the bench's small decode workload (a smoke run)")
    a = ap.parse_args()
    lw = (QUICK_LAYER_WORKLOADS if a.quick else LAYER_WORKLOADS)[0]
    w = lw.w
    p = make_problem(w, seed=1, fill="selected")
    rng = np.random.default_rng(2)
    qs = [rng.standard_normal(p["q"].shape, dtype=np.float32) for _ in range(lw.layers)]
    names = a.backends or [n for n, av in registry.list_backends().items() if av.ok and n != "numpy"]
    t_all = time.perf_counter()
    for name in names:
        be = registry.get_backend(name)
        kd, vd = be.upload_kv_cache(p["k_cache"], p["v_cache"])
        qd = [be.asarray(q) for q in qs]
        sd = be.asarray(p["selected"])
        print(f"== {name}: {be}", flush=True)
        for rnd in range(2):  # two rounds: run-order effects show as differences between them
            for vname in VARIANTS:
                undo = _variant(vname)
                try:
                    plan = _plan(be, lw, p)
                    issued: list = []
                    t = _loop_time(lambda i: plan.run(qd[i], kd, vd, sd), lambda r: r.numpy(), lw.layers, a.repeat,
                                   False, issued)
                    print(f"  round {rnd}: {vname:16s} {t * 1e6:8.1f} us per layer (host {issued[0] * 1e6:6.1f})",
                          flush=True)
                    plan.close()
                finally:
                    undo()
        be.close()
    print(f"done in {time.perf_counter() - t_all:.1f} s")


if __name__ == "__main__":
    main()
