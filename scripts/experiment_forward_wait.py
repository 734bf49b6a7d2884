"""``forward()`` with host arrays on the decode layer workload: how its wait for the results is made,
and whether a CUDA context in the process changes it.

Usage: ``python scripts/experiment_forward_wait.py [--backends dawn wgpu] [--rounds 3] [--torch]``

Times loops of 32 ``forward()`` calls (host ``q`` of its own per call, host selection, results
read back; the ``layer`` suite's ``forward() numpy`` row), median microseconds per call and the
runtime's split of the last call (encode, submit, wait, read), in alternating rounds of two
modes of the wait:

* ``map``: the result buffer's map waits for the submission (as the backends do);
* ``queue, then map`` (Dawn): ``on_submitted_work_done`` first, then the map of finished work.

``--torch`` first makes a CUDA context in the process (``torch.zeros(1, device="cuda")``), as the
bench does for its peers, and runs the same rounds again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li

import paged_sparse_attn as psa
from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu import _layer

_MAP = _layer.map_read


def _queue_then_map(buf, nbytes):
    buf._device.queue.on_submitted_work_done_sync()
    return _MAP(buf, nbytes)


def _rounds(names, prob, lw, rounds, label):
    rng = np.random.default_rng(4)
    qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(32)]
    bes = {n: registry.get_backend(n) for n in names}
    kv = {n: be.upload_kv_cache(prob["k_cache"], prob["v_cache"]) for n, be in bes.items()}
    modes = {"map": _MAP, "queue, then map": _queue_then_map}
    res: dict = {}
    for rnd in range(rounds):
        for n, be in bes.items():
            for mode, fn in modes.items():
                if mode != "map" and not be.device_context.runtime.work_done_wait:
                    continue
                _layer.map_read = fn
                try:
                    kd, vd = kv[n]
                    kw = {"used_kv_lens": prob["used_kv_lens"], "block_size": lw.w.block_size,
                          "causal": lw.w.causal, "backend": be}
                    for i in range(4):
                        psa.forward(qs[i], kd, vd, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"], **kw)
                    ts = []
                    for i in range(32):
                        t0 = time.perf_counter()
                        psa.forward(qs[i], kd, vd, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"], **kw)
                        ts.append(time.perf_counter() - t0)
                    t = be.last_timings
                    row = [np.median(ts) * 1e6] + [t.get(k, np.nan) * 1e6 for k in ("encode_s", "submit_s", "wait_s",
                                                                                       "read_s")]
                    res.setdefault((n, mode), []).append(row)
                    print(f"  {label} round {rnd} {n:5s} {mode:16s} forward() {row[0]:7.1f} us  (last call: encode "
                          f"{row[1]:6.1f} submit {row[2]:6.1f} wait {row[3]:6.1f} read {row[4]:6.1f})", flush=True)
                finally:
                    _layer.map_read = _MAP
    for (n, mode), rows in res.items():
        m = np.median(np.array(rows), axis=0)
        print(f"{label}: {n:5s} {mode:16s} median forward() {m[0]:7.1f} us; encode {m[1]:6.1f} submit {m[2]:6.1f} "
              f"wait {m[3]:6.1f} read {m[4]:6.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="*", default=["dawn", "wgpu"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a small decode problem (a smoke run on a CPU driver)")
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs("decode", (1, 2048) if a.quick else None)
    _rounds(a.backends, prob, lw, a.rounds, "no CUDA context")
    if a.torch:
        import torch

        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        _rounds(a.backends, prob, lw, a.rounds, "with a CUDA context")


if __name__ == "__main__":
    main()
