"""The layer suite's decode loops (32 layers of device arrays, one sync at the end): wall and host
microseconds per layer of ``plan.run`` and ``plan.run_sparse``, 11 loops each after a warm one.

Usage: ``TAG=label python scripts/experiment_decode_loops.py [dawn] [wgpu]``. To compare two
versions of the code, run it once per checkout, alternating, with ``PYTHONPATH`` pointing at
each one's ``src`` (the shaders are found beside it); every line carries ``TAG`` and two output
values, which must agree between versions that claim the same bits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _layer_inputs import decode_calls, layer_inputs, on_device, timed_loops

from paged_sparse_attn import registry


def loops(name: str, lw, prob, iqs, ik, tag: str) -> None:
    d = on_device(registry.get_backend(name), lw, prob, iqs, ik)
    be, plan = d.be, d.plan
    calls = decode_calls(d)
    acc = timed_loops(calls, be.synchronize, 12)
    o = plan.run(d.q[0], d.k, d.v, d.sel).numpy()
    for w, a in acc.items():
        print(f"{tag} {name} {w:9s}: wall {np.median(a[:, 0]):6.1f} us/layer (min {a[:, 0].min():6.1f}), "
              f"host {np.median(a[:, 1]):6.1f} (min {a[:, 1].min():6.1f})  out[0,0,:2]={o[0, 0, :2]}", flush=True)
    plan.close()
    be.close()


if __name__ == "__main__":
    lw, prob, iqs, ik = layer_inputs("decode")
    for name in sys.argv[1:] or ["dawn", "wgpu"]:
        loops(name, lw, prob, iqs, ik, os.environ.get("TAG", "?"))
