"""Experiment: the planned attention kernels on Dawn devices with extra device toggles.

Each toggle set opens a fresh ``dawn`` device (bounds checks off, as the backend's default, plus
the set's toggles) and times a planned attention call's partials and combine (GPU timestamps,
median of ``--calls``) on the bench's decode and prefill layer workloads, in alternating rounds;
every output is compared bit for bit with the first set's. The default set adds
``disable_polyfills_on_integer_div_and_mod`` (Tint then emits integer divisions and remainders
without its guard against a zero divisor).

    python scripts/experiment_dawn_toggles.py [--toggle NAME ...] [--rounds 2] [--calls 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li

from paged_sparse_attn import registry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toggle", action="append", default=[], help="a device toggle to add (repeatable; "
                    "default: disable_polyfills_on_integer_div_and_mod)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--workload", action="append", choices=["decode", "prefill"], default=[])
    a = ap.parse_args()
    extra = tuple(a.toggle) or ("disable_polyfills_on_integer_div_and_mod",)
    sets = {"as the backend opens it": (), "+ " + ", ".join(extra): extra}
    inputs = {w: li.layer_inputs(w)[:2] for w in (a.workload or ["decode", "prefill"])}
    res: dict = {}
    first: dict = {}
    for r in range(a.rounds):
        for label, toggles in sets.items():
            be = type(registry.get_backend("dawn"))(timestamps=True)
            be._device_toggles = tuple(be._device_toggles) + toggles  # (before the device is opened)
            try:
                for w, (lw, prob) in inputs.items():
                    t, out, geo = li.attention_gpu_time(be, lw, prob, a.calls)
                    o = np.asarray(out[0])
                    same = first.setdefault(w, o)
                    cmp = "same bits" if np.array_equal(o, same, equal_nan=True) else \
                        f"max diff {float(np.nanmax(np.abs(o - same))):.3g}"
                    res.setdefault((w, label), []).append(t)
                    print(f"round {r}: {w:8s} {label:60s} {t * 1e6:9.1f} us  ({geo.get('kernel')}; {cmp})",
                          flush=True)
            finally:
                be.close()
    print("medians:")
    for (w, label), ts in res.items():
        print(f"  {w:8s} {label:60s} {np.median(ts) * 1e6:9.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
