"""Experiment: a prefill ``forward()`` with host arrays, through host memory the GPU maps (as the
library runs it on Dawn since 2026-12-04: ``q`` copied into the plan's pinned memory, results
written by the GPU into host memory) or as before (``q`` by ``write_buffer``, the results read
back through a mapped buffer), and each half of the change alone; and the library with its copy
of ``q`` into pinned memory done by one thread (``q copied by one thread``: as before
2026-12-04 02:20, when ``_host_io.copy_in`` began to split large copies among threads).

The bench's prefill layer workload (B = 1, L = 32k, the last 4096 queries, causal, Hq = 32,
Hkv = 4, D = 128, top-16 of 128-token blocks, float16 caches resident; ``q`` and ``out`` 64 MiB
each), ``forward()`` with numpy ``q`` and ``selected``: each variant on a backend of its own
(one device each), ``--rounds`` rounds in turn of ``--calls`` calls; per variant the median wall
time per call and the runtime's stage medians, and whether the variants' outputs are the same
bits.

    python scripts/experiment_prefill_forward.py [--rounds 3] [--calls 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--shape", type=int, nargs=2, default=None, metavar=("TQ", "L"),
                    help="a smaller prefill (to try the script on a CPU driver)")
    a = ap.parse_args()
    import _layer_inputs as li

    import paged_sparse_attn as psa
    from paged_sparse_attn.backends.wgpu import _host_io, _layer

    lw, prob, _, _ = li.layer_inputs("prefill", a.shape)
    lib_host_io, lib_host_input = _layer.host_io, _layer.host_input

    def none(*x, **y):
        return None

    variants = {}
    threads = _host_io.COPY_THREADS
    for name, hio, hin in (("library", lib_host_io, lib_host_input), ("q copied by one thread", lib_host_io,
                                                                     lib_host_input),
                           ("q written", lib_host_io, none), ("results mapped", none, lib_host_input),
                           ("both as before", none, none)):
        be = type(psa.get_backend(a.backend))()
        k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])

        def call(be=be, k=k, v=v):
            return psa.forward(prob["q"], k, v, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"],
                               used_kv_lens=prob["used_kv_lens"], block_size=lw.w.block_size, causal=lw.w.causal,
                               backend=be)

        _layer.host_io, _layer.host_input = hio, hin  # (read when the plan's first call makes its transport)
        try:
            first = np.array(call())
        finally:
            _layer.host_io, _layer.host_input = lib_host_io, lib_host_input
        rts = [p._runtime for p, *_ in psa._attention_plan._cache.values() if p.backend is be]
        variants[name] = {"call": call, "be": be, "first": first, "walls": [], "splits": {},
                          "threads": 1 if name == "q copied by one thread" else threads,
                          "uses": (any(getattr(r, "hin", None) is not None for r in rts),
                                   any(getattr(r, "hio", None) is not None for r in rts))}
    for _ in range(a.rounds):
        for name, var in variants.items():
            _host_io.COPY_THREADS = var["threads"]
            for _ in range(a.calls):
                t = time.perf_counter()
                out = var["call"]()
                var["walls"].append(time.perf_counter() - t)
                for key, val in var["be"].last_timings.items():
                    if isinstance(val, float):
                        var["splits"].setdefault(key, []).append(val)
                del out
    _host_io.COPY_THREADS = threads
    ref = next(iter(variants.values()))["first"]
    for name, var in variants.items():
        med = {key: round(float(np.median(val)) * 1e3, 2) for key, val in var["splits"].items()}
        print(f"{name:16s} (pinned q, pinned results: {var['uses']}): forward() median "
              f"{np.median(var['walls']) * 1e3:.2f} ms over {len(var['walls'])} calls; runtime medians (ms) {med}; "
              f"same bits as the first variant: {bool(np.array_equal(var['first'], ref))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
