"""Where the host time of ``forward()`` goes: decode calls with host arrays, on resident caches.

Usage::

    python scripts/profile_host.py --stages --backend dawn --backend wgpu
    python scripts/profile_host.py [--backend wgpu] [--calls 200] [--workload decode] [--top 30]

``--native`` times every call into the WebGPU runtime (wgpu-py's classes: encoder, pass,
queue, device, buffer), outermost calls only, in two loops: ``forward()`` with host arrays, and
a plan's pipelined decode loops on device arrays (``AttentionPlan.run`` and ``run_sparse``, 32
layers with their own queries, one sync at the end):
microseconds per call (per layer) of each method, and the Python left around them.

``--stages`` prints one line per stage of a call, in microseconds per call (median over the
calls), for each backend in one process: the checks before the backend (validation of every
input, backend resolution and capability checks, the plan-cache lookup), the plan runtime's
encode, submit, wait (until the results are mapped) and read (results copied out, ``lse``
computed, R6 error words checked), the checks of the results, and what is left of the wall
time. Without it, a cProfile of the calls (the functions with the most cumulative time).

Measures what a user's call runs (host ``q`` and ``selected`` in, host ``out`` and ``lse``
back). ``--L`` shortens the sequences (a CPU driver cannot hold or run the full decode caches
fast); ``--keep N`` keeps only the first N slots of every selection row (the others -1): the
host work is the same, the GPU's is less.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import numpy as np

import paged_sparse_attn as psa
from paged_sparse_attn import _api, _attention_plan, _layout
from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage
from paged_sparse_attn.bench.layer import LAYER_WORKLOADS, QUICK_LAYER_WORKLOADS
from paged_sparse_attn.bench.workloads import make_problem

# the functions forward() calls before and after the backend's runtime, by stage (timed by
# wrapping the module attribute forward() reads them from; those a release lacks are skipped)
STAGES = (("validate", _api, "validate_forward"),
          ("backend checks", _api, "resolve_backend"),
          ("backend checks", _api, "_run_checks"),
          ("plan lookup", _attention_plan, "forward_plan"),
          ("plan lookup", _layout, "layout_of"),  # (older releases: layout_of + cached_plan)
          ("plan lookup", _attention_plan, "cached_plan"),
          ("result checks", _api, "checked_out_lse"))
INDEX_DIM = 128  # the MSA layer's index head dim (as the bench's layer suite)
RUNTIME = (("encode", "encode_s"), ("submit", "submit_s"), ("wait", "wait_s"), ("read + lse", "read_s"))


def _problem(a):
    lw = {x.w.name: x for x in (*LAYER_WORKLOADS, *QUICK_LAYER_WORKLOADS)}[a.workload]
    w = dataclasses.replace(lw.w, L=a.L) if a.L else lw.w
    p = make_problem(w, seed=1, fill="selected")
    if a.keep is not None:
        p["selected"] = np.where(np.arange(p["selected"].shape[2]) < a.keep, p["selected"], -1).astype(np.int32)
    return w, p


def _forward_call(name: str, p: dict):
    """``(backend, k, v, args, kwargs)`` of a decode ``forward()`` call on resident caches."""
    be = psa.get_backend(name)
    k, v = be.upload_kv_cache(p["k_cache"], p["v_cache"])
    args = (p["q"], k, v, p["block_tables"], p["selected"], p["cu_seqlens_q"])
    kw = dict(used_kv_lens=p["used_kv_lens"], block_size=p["block_size"], causal=p["causal"], backend=be)
    return be, k, v, args, kw


def _stages(name: str, p: dict, calls: int) -> None:
    be, k, v, args, kw = _forward_call(name, p)
    kw["return_lse"] = True
    spent: dict[str, float] = {}
    saved = []
    for label, mod, attr in STAGES:
        fn = getattr(mod, attr, None)
        if fn is None:
            continue
        saved.append((mod, attr, fn))

        def timed(*x, _fn=fn, _label=label, **y):
            t = time.perf_counter()
            try:
                return _fn(*x, **y)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - t
        setattr(mod, attr, timed)
    rows: dict[str, list] = {}
    try:
        for i in range(calls + 10):
            spent.clear()
            t0 = time.perf_counter()
            psa.forward(*args, **kw)
            wall = time.perf_counter() - t0
            if i < 10:
                continue  # warm-up: pipelines, bind groups, the plan
            t = be.last_timings
            if t.get("path") != "device":
                raise SystemExit(f"{name}: forward() did not take the plan runtime (caches not resident in one "
                                 "binding?); try a smaller --L")
            row = dict(spent)
            row["plan lookup"] = row.get("plan lookup", 0.0)
            for label, key in RUNTIME:
                row[label] = t.get(key, 0.0)
            row["other"] = wall - sum(row.values())
            row["forward() total"] = wall
            row["  of which outside the runtime"] = wall - t["total_s"]
            for key, val in row.items():
                rows.setdefault(key, []).append(val)
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
        k.release()
        v.release()
    print(f"{name} ({be.device_summary}): forward() stages, median us per call of {calls}")
    order = ["validate", "backend checks", "plan lookup"] + [r[0] for r in RUNTIME] + [
        "result checks", "other", "forward() total", "  of which outside the runtime"]
    for key in order:
        print(f"  {key:32s} {np.median(rows[key]) * 1e6:9.1f}")


class _NativeTimer:
    """Wraps the public methods of the runtime's classes with a timer (outermost calls only)."""

    def __init__(self, objs):
        self.spent: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.depth = 0
        self.saved = []
        for cls in {type(o) for o in objs}:
            for klass in cls.__mro__:
                if klass is object:
                    continue
                for attr, fn in list(vars(klass).items()):
                    if attr.startswith("_") or not callable(fn) or isinstance(fn, (staticmethod, classmethod, type)):
                        continue
                    if any(s[0] is cls and s[1] == attr for s in self.saved):
                        continue
                    self.saved.append((cls, attr, cls.__dict__.get(attr)))
                    setattr(cls, attr, self._wrap(f"{cls.__name__}.{attr}", getattr(cls, attr)))

    def _wrap(self, name, fn):
        def timed(*a, **k):
            if self.depth:
                return fn(*a, **k)
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
                self.count[name] = self.count.get(name, 0) + 1
                self.depth -= 1
        return timed

    def reset(self):
        self.spent.clear()
        self.count.clear()

    def restore(self):
        for cls, attr, fn in self.saved:
            if fn is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, fn)

    def report(self, title: str, n: int, wall: float) -> None:
        tot = sum(self.spent.values())
        print(f"  {title}: {wall / n * 1e6:.1f} us wall per call, {tot / n * 1e6:.1f} in the runtime, "
              f"{(wall - tot) / n * 1e6:.1f} in Python around it")
        for name, s in sorted(self.spent.items(), key=lambda x: -x[1]):
            print(f"    {name:44s} {s / n * 1e6:8.1f} us  ({self.count[name] / n:.1f} calls)")


def _native(name: str, p: dict, calls: int) -> None:
    be, k, v, args, kw = _forward_call(name, p)
    for _ in range(10):
        psa.forward(*args, **kw)
    dev = be.device_context.device
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.end()
    buf = dev.create_buffer(size=16, usage=BufferUsage.STORAGE)
    objs = (dev, dev.queue, enc, cp, buf, enc.finish())
    Tq, Hq, D = p["q"].shape
    plan_page = k.shape[2] if k.kv_layout == "HND" else k.shape[1]
    plan = psa.plan_attention(p["block_tables"], p["cu_seqlens_q"], p["used_kv_lens"], block_size=p["block_size"],
                              page_size=plan_page, num_q_heads=Hq, num_kv_heads=p["selected"].shape[1], head_dim=D,
                              kv_dtype=k.dtype, topk=p["selected"].shape[2], causal=p["causal"],
                              index_dim=INDEX_DIM, num_index_heads=1, index_dtype=k.dtype, backend=be)
    layers = 32
    rng = np.random.default_rng(0)
    qd = [be.asarray(rng.standard_normal(p["q"].shape, dtype=np.float32)) for _ in range(layers)]
    sd = be.asarray(p["selected"])
    iqd = [be.asarray(rng.standard_normal((Tq, p["selected"].shape[1], INDEX_DIM), dtype=np.float32))
           for _ in range(layers)]
    ikd = be.upload_index_cache(rng.standard_normal((k.shape[0], 1, plan_page, INDEX_DIM), dtype=np.float32)
                                .astype(k.dtype))
    for _ in range(3):
        res = [plan.run(qd[i], k, v, sd) for i in range(layers)]
        res[-1].numpy()
        res = [plan.run_sparse(qd[i], k, v, iqd[i], ikd) for i in range(layers)]
        res[-1].numpy()
    del res
    timer = _NativeTimer(objs)
    print(f"{name} ({be.device_summary}): calls into the runtime, outermost only")
    try:
        for what in ("forward", "plan", "sparse"):
            best = None
            for _ in range(3):
                timer.reset()
                t0 = time.perf_counter()
                if what == "forward":
                    for _ in range(calls):
                        psa.forward(*args, **kw)
                    n = calls
                else:
                    for _ in range(max(1, calls // layers)):
                        last = None
                        for i in range(layers):
                            last = (plan.run(qd[i], k, v, sd) if what == "plan" else
                                    plan.run_sparse(qd[i], k, v, iqd[i], ikd))
                        last.numpy()
                    n = max(1, calls // layers) * layers
                wall = time.perf_counter() - t0
                if best is None or wall < best[0]:
                    best = (wall, dict(timer.spent), dict(timer.count))
            timer.spent, timer.count = best[1], best[2]
            title = {"forward": "forward(), host arrays",
                     "plan": f"AttentionPlan.run, device arrays, {layers} layers then one sync (per layer)",
                     "sparse": f"AttentionPlan.run_sparse (whole MSA layer), device arrays, {layers} layers then "
                               "one sync (per layer)"}[what]
            timer.report(title, n, best[0])
    finally:
        timer.restore()
        plan.close()
        for a in (k, v, ikd):
            a.release()


def _cprofile(name: str, p: dict, calls: int, workload: str, top: int) -> None:
    be, k, v, args, kw = _forward_call(name, p)
    for _ in range(20):
        psa.forward(*args, **kw)
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        psa.forward(*args, **kw)
    prof.disable()
    wall = (time.perf_counter() - t0) / calls
    print(f"forward() {workload} on {name}: {wall * 1e6:.0f} us per call under the profiler; last call's split: "
          f"{ {k: round(v * 1e6) for k, v in be.last_timings.items() if isinstance(v, float)} } us")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    t0 = time.perf_counter()
    for _ in range(calls):
        psa.forward(*args, **kw)
    print(f"forward() without the profiler: {(time.perf_counter() - t0) / calls * 1e6:.0f} us per call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append", help="repeatable (default: wgpu)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--workload", default="decode")
    ap.add_argument("--L", type=int, default=None, help="KV length of every sequence (default: the workload's)")
    ap.add_argument("--keep", type=int, default=None, help="selection slots kept per row (default: all)")
    ap.add_argument("--stages", action="store_true", help="per-stage times instead of a cProfile")
    ap.add_argument("--native", action="store_true", help="time each call into the WebGPU runtime")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    w, p = _problem(a)
    print(f"workload {a.workload}: B={w.B} L={w.L} Tq/seq={w.Tq_per_seq} Hq={w.Hq} Hkv={w.Hkv} D={w.D} "
          f"page={w.page_size} block={w.block_size} topk={w.topk} {w.dtype}"
          + (f", {a.keep} slots kept per row" if a.keep is not None else ""))
    for name in a.backend or ["wgpu"]:
        if a.native:
            _native(name, p, a.calls)
        elif a.stages:
            _stages(name, p, a.calls)
        else:
            _cprofile(name, p, a.calls, a.workload, a.top)


if __name__ == "__main__":
    main()
