"""Experiment: the layer suite's decode loops with N layers recorded into one command encoder
(one ``finish`` and one submission per N layers), with and without each layer's two
non-dispatch commands (the R6 error words' clear before the pass and copy after it). Timing
only: the runtime's encoder and queue are wrapped in the timed loops (device arrays: no write
between the layers), and without the clear and copy the error words are not handed over.

Usage: ``python scripts/experiment_defer_layers.py [wgpu] [dawn]`` (three rounds).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _layer_inputs import decode_calls, on_device, run_decode

from paged_sparse_attn import registry


class _Token:
    """What the wrapped encoder's ``finish`` hands out: nothing to submit until the Nth layer."""


class _Shared:
    """One real encoder for N layers: ``create_command_encoder`` hands out wrappers of it."""

    def __init__(self, dev, n: int, skip_clear_copy: bool):
        self.dev, self.n, self.skip = dev, n, skip_clear_copy
        self.make = dev.create_command_encoder
        self.submit = dev.queue.submit
        self.enc = None
        self.layers = 0

    def encoder(self, **kw):
        if self.enc is None:
            self.enc = self.make(**kw)
        return _Enc(self)

    def flush(self) -> None:
        if self.enc is not None:
            enc, self.enc, self.layers = self.enc, None, 0
            self.submit([enc.finish()])

    def queue_submit(self, cbs) -> None:
        if all(isinstance(c, _Token) for c in cbs):
            self.layers += 1
            if self.layers >= self.n:
                self.flush()
        else:
            self.flush()
            self.submit(cbs)


class _Enc:
    def __init__(self, shared: _Shared):
        self._s = shared

    def __getattr__(self, name):
        return getattr(self._s.enc, name)

    def clear_buffer(self, *a, **k):
        if not self._s.skip:
            self._s.enc.clear_buffer(*a, **k)

    def copy_buffer_to_buffer(self, *a, **k):
        if not self._s.skip:
            self._s.enc.copy_buffer_to_buffer(*a, **k)

    def finish(self, **kw):
        return _Token()


def run(name: str, lw, prob, iqs, ik, res: dict) -> None:
    d = on_device(registry.get_backend(name), lw, prob, iqs, ik)
    be = d.be
    dev = be.device_context.device
    queue = dev.queue
    calls = decode_calls(d)
    modes = [(1, False), (4, False), (1, True), (4, True), (8, True)]
    for rnd in range(3):
        for n, skip in modes:
            for what, call in calls.items():
                per = []
                for rep in range(6):
                    sh = _Shared(dev, n, skip)
                    dev.create_command_encoder = sh.encoder
                    queue.submit = sh.queue_submit
                    try:
                        t0 = time.perf_counter()
                        for i in range(32):
                            call(i)
                        t1 = time.perf_counter()
                    finally:
                        del dev.create_command_encoder
                        del queue.submit
                    sh.flush()
                    be.synchronize()
                    if rep:
                        per.append(((time.perf_counter() - t0) / 32, (t1 - t0) / 32))
                p = np.median(np.array(per), axis=0)
                label = f"{n} per encoder{', no clear/copy' if skip else ''}"
                res.setdefault((name, what, label), []).append(p)
                print(f"round {rnd} {name} {what:9s} {label:28s}: {p[0] * 1e6:6.1f} us/layer, host {p[1] * 1e6:6.1f}",
                      flush=True)


if __name__ == "__main__":
    run_decode(run, sys.argv[1:] or ["wgpu", "dawn"])
