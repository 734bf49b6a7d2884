"""The problem an experiment script times: the ``layer`` suite's prefill or decode workload.

``add_arguments`` declares ``--workload`` and ``--shape``; ``layer_inputs`` builds the workload's
problem (caches, selection, block tables) and its index inputs, as the bench's ``layer`` suite
does, with two index-query sets (the scripts alternate them between calls).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn.bench.layer import LAYER_WORKLOADS, _index_inputs
from paged_sparse_attn.bench.workloads import make_problem

__all__ = ["add_arguments", "layer_inputs"]


def add_arguments(ap) -> None:
    """``--workload prefill|decode`` and ``--shape TQ L`` on an argparse parser."""
    ap.add_argument("--workload", choices=["prefill", "decode"], default="prefill")
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
