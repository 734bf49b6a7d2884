"""GPU time of each command of a planned attention layer: every clear, copy and dispatch apart.

Usage: ``python scripts/experiment_layer_commands.py [--backend dawn] [--workload prefill]
[--calls 9] [--shape TQ L]``.

``AttentionPlan.run`` records one layer as a few clears and copies and two compute passes of
several dispatches (the inversion, then the partials and the combine). GPU timestamps exist only
at the start and end of a compute pass, so this script encodes the layer through the runtime's
own encoding (``DeviceRuntime._encode``, device-resident ``q`` and selection as in the bench's
``layer`` suite) with an encoder that puts every dispatch in a compute pass of its own and writes
a timestamp after every command (an empty pass after each clear or copy). The difference between
consecutive timestamps is what the command adds to the layer on the GPU: its own work and the
barrier before the next. Splitting the passes adds a little of its own (a pass boundary per
dispatch); the sum is printed beside the plain call's two passes from the runtime's timestamps.
Each call's results are those of the plain call (the commands are the same, in the same order):
the script compares them bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _layer_inputs as li

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu._transfer import map_read
from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage, QueryType

MAX_STAMPS = 64


class _Pass:
    """A compute pass that becomes one real pass per dispatch, each ended by a timestamp."""

    def __init__(self, enc: _Encoder, label: str):
        self.enc, self.label, self.pipe, self.groups, self.n = enc, label, None, {}, 0

    def set_pipeline(self, pipe):
        self.pipe = pipe

    def set_bind_group(self, i, bg, *rest):
        self.groups[i] = bg

    def _run(self, how: str, *args):
        name = self.enc.names.get(id(self.pipe), "?")
        cp = self.enc.enc.begin_compute_pass(timestamp_writes=self.enc.stamp(f"{self.label}.{self.n} {name}"))
        cp.set_pipeline(self.pipe)
        for i, bg in self.groups.items():
            cp.set_bind_group(i, bg)
        getattr(cp, how)(*args)
        cp.end()
        self.n += 1

    def dispatch_workgroups(self, x, y=1, z=1):
        self._run("dispatch_workgroups", x, y, z)

    def dispatch_workgroups_indirect(self, buf, offset):
        self._run("dispatch_workgroups_indirect", buf, offset)

    def end(self):
        pass


class _Encoder:
    """A command encoder whose every command is followed by a timestamp (``labels[i]``)."""

    def __init__(self, device, qset, names: dict):
        self.enc, self.qset, self.labels, self.passes = device.create_command_encoder(), qset, [], 0
        self.names = names
        self._empty("start")

    def stamp(self, label: str) -> dict:
        self.labels.append(label)
        return {"query_set": self.qset, "end_of_pass_write_index": len(self.labels) - 1}

    def _empty(self, label: str) -> None:
        self.enc.begin_compute_pass(timestamp_writes=self.stamp(label)).end()

    def clear_buffer(self, buf, offset=0, size=None):
        self.enc.clear_buffer(buf, offset, size)
        self._empty(f"clear {buf.label} {size}")

    def copy_buffer_to_buffer(self, src, so, dst, do, n):
        self.enc.copy_buffer_to_buffer(src, so, dst, do, n)
        self._empty(f"copy {src.label}->{dst.label} {n}")

    def begin_compute_pass(self, timestamp_writes=None):
        self.passes += 1
        return _Pass(self, f"pass{self.passes}")

    def __getattr__(self, name):
        return getattr(self.enc, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--calls", type=int, default=9)
    li.add_arguments(ap)
    a = ap.parse_args()
    lw, prob, _, _ = li.layer_inputs(a.workload, a.shape)
    be = type(registry.get_backend(a.backend))(timestamps=True)
    d = li.on_device(be, lw, prob, layers=2)
    rt = d.plan._runtime
    if not hasattr(rt, "_encode"):
        print(f"{a.backend}: the plan runs on the host ({type(rt).__name__}); nothing to split")
        return 1
    ref = d.plan.run(prob["q"], d.k, d.v, prob["selected"])  # warm, and the plain call's timestamps
    plain = []
    for _ in range(3):
        d.plan.run(prob["q"], d.k, d.v, prob["selected"])
        plain.append((be.last_timings["gpu_invert_s"], be.last_timings["gpu_attention_s"]))
    dev = rt.ctx.device
    qset = dev.create_query_set(type=QueryType.timestamp, count=MAX_STAMPS)
    resolve = dev.create_buffer(size=8 * MAX_STAMPS, usage=BufferUsage.QUERY_RESOLVE | BufferUsage.COPY_SRC)
    readb = dev.create_buffer(size=8 * MAX_STAMPS, usage=BufferUsage.MAP_READ | BufferUsage.COPY_DST)
    k = rt.ctx.ns_per_tick * 1e-3  # microseconds per tick
    rec, rt.rec = rt.rec, None  # (the runtime's C recorder bypassed: the wrapper records through the API)
    names = {id(p[0]): f"{kind} {e}" for kind, table in (("invert", rt.p_inv), ("scan", rt.p_scan))
             for e, p in table.items()}
    names[id(rt.p_part[0])], names[id(rt.p_merge[0])] = "partials", "combine"
    rows: dict[str, list[float]] = {}
    order: list[str] = []
    try:
        for c in range(a.calls + 1):
            enc = _Encoder(dev, qset, names)
            rt._encode(enc, d.q[c % 2], d.k, d.v, d.sel)
            n = len(enc.labels)
            enc.enc.resolve_query_set(qset, 0, n, resolve, 0)
            enc.enc.copy_buffer_to_buffer(resolve, 0, readb, 0, 8 * n)
            dev.queue.submit([enc.enc.finish()])
            ts = np.frombuffer(map_read(readb, 8 * n), dtype=np.uint64).astype(np.int64).copy()
            readb.unmap()
            if c == 0:
                continue
            for lab, dt in zip(enc.labels[1:], np.diff(ts)):
                if lab not in rows:
                    order.append(lab)
                rows.setdefault(lab, []).append(dt * k)
    finally:
        rt.rec = rec
    total = 0.0
    print(f"{a.backend}, {a.workload}: GPU microseconds per command (median of {a.calls} calls; "
          f"labels: passN.i = dispatch i of the plain call's pass N)")
    for lab in order:
        m = float(np.median(rows[lab]))
        total += m
        print(f"  {lab:<44} {m:9.1f}")
    pi, pa = np.median(np.array(plain), axis=0) * 1e6
    print(f"  {'sum':<44} {total:9.1f}   (plain call's passes: inversion {pi:.1f}, partials+combine {pa:.1f})")
    out = d.plan.run(prob["q"], d.k, d.v, prob["selected"])
    same = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(ref, out))
    print(f"the plain call's results after the split calls: {'same bits' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
