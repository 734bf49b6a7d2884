"""The problem an experiment script times: the ``layer`` suite's prefill or decode workload.

``add_arguments`` declares ``--workload`` and ``--shape``; ``layer_inputs`` builds the workload's
problem (caches, selection, block tables) and its index inputs, as the bench's ``layer`` suite
does, with two index-query sets (the scripts alternate them between calls); ``on_device`` puts
them on a backend with the workload's plan and 32 layers of queries (device arrays), and
``decode_calls`` gives the two loops' calls.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn.bench.layer import LAYER_WORKLOADS, _index_inputs, _plan
from paged_sparse_attn.bench.workloads import make_problem

__all__ = ["add_arguments", "add_shape_argument", "attention_gpu_time", "decode_calls", "layer_inputs", "on_device", "run_decode",
           "timed_loops"]


def add_arguments(ap) -> None:
    """``--workload prefill|decode`` and ``--shape TQ L`` on an argparse parser."""
    ap.add_argument("--workload", choices=["prefill", "decode"], default="prefill")
    add_shape_argument(ap)


def add_shape_argument(ap) -> None:
    """``--shape TQ L`` on an argparse parser (the prefill scripts' smaller problem)."""
    ap.add_argument("--shape", type=int, nargs=2, default=None, metavar=("TQ", "L"),
                    help="a smaller prefill (queries, cached positions) to try the script on a CPU driver")


def layer_inputs(workload: str, shape=None):
    """``(layer workload, problem, index queries [2], index keys)`` of ``workload``, its queries
    and cached positions replaced by ``shape = (TQ, L)`` when given."""
    lw = {x.w.name: x for x in LAYER_WORKLOADS}[workload]
    if shape:
        lw = dataclasses.replace(lw, w=dataclasses.replace(lw.w, Tq_per_seq=shape[0], L=shape[1]))
    prob = make_problem(lw.w, seed=1, fill="selected")
    iqs, ik = _index_inputs(lw, prob, seed=2)
    return lw, prob, iqs[:2], ik


def on_device(be, lw, prob, iqs=None, ik=None, layers: int = 32):
    """The problem on backend ``be``: resident caches (``k``, ``v``; ``ik`` when index keys are
    given), the workload's plan, ``layers`` query sets (``q``, device arrays of seed 2), the index
    queries (``iq``) and the selection (``sel``)."""
    k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
    rng = np.random.default_rng(2)
    return SimpleNamespace(
        be=be, k=k, v=v, plan=_plan(be, lw, prob), sel=be.asarray(prob["selected"]),
        q=[be.asarray(rng.standard_normal(prob["q"].shape, dtype=np.float32)) for _ in range(layers)],
        ik=be.upload_index_cache(ik) if ik is not None else None, iq=[be.asarray(x) for x in iqs or []])


def attention_gpu_time(be, lw, prob, calls: int):
    """``(median seconds, output, plan geometry)`` of ``calls`` planned attention calls of the
    workload on a fresh device of ``be`` (one layer of queries; host ``q``, so that each call reads
    its timestamps: ``gpu_attention_s``, the partials and combine), after one warm-up call."""
    d = on_device(be, lw, prob, layers=1)
    ts, out = [], None
    for i in range(calls + 1):
        out = d.plan.run(prob["q"], d.k, d.v, prob["selected"])
        if i:
            ts.append(be.last_timings.get("gpu_attention_s", np.nan))
    return float(np.median(ts)), out, d.plan._runtime.geometry


def decode_calls(d) -> dict:
    """Layer ``i``'s call of the two loops on ``on_device``'s ``d``: attention given the selection
    (``plan.run``) and the whole MSA layer (``plan.run_sparse``)."""
    n = len(d.q)
    return {"attention": lambda i: d.plan.run(d.q[i % n], d.k, d.v, d.sel),
            "layer": lambda i: d.plan.run_sparse(d.q[i % n], d.k, d.v, d.iq[i % len(d.iq)], d.ik)}


def timed_loops(calls: dict, sync, rounds: int, layers: int = 32) -> dict:
    """``rounds`` loops of ``layers`` calls per entry of ``calls`` (entries alternating, the
    first loop a warm-up), ``sync()`` after each loop: per entry an array [rounds - 1, 2] of the
    wall and the host (until the last call returned) microseconds per layer."""
    acc: dict = {w: [] for w in calls}
    for rnd in range(rounds):
        for w, f in calls.items():
            t0 = time.perf_counter()
            for i in range(layers):
                f(i)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if rnd:
                acc[w].append(((t2 - t0) / layers * 1e6, (t1 - t0) / layers * 1e6))
    return {w: np.array(v) for w, v in acc.items()}


def run_decode(run, names: list[str]) -> None:
    """``run(name, lw, prob, iqs, ik, res)`` for each backend name on the decode workload, each
    filling ``res`` with per-round ``[wall, host]`` seconds per layer by key; then the medians."""
    lw, prob, iqs, ik = layer_inputs("decode")
    res: dict = {}
    for name in names:
        run(name, lw, prob, iqs, ik, res)
    for k, v in res.items():
        m = np.median(np.array(v), axis=0)
        print("median", k, f"{m[0] * 1e6:.1f} us/layer, host {m[1] * 1e6:.1f}")
