"""Benchmark harness: ``python -m paged_sparse_attn.bench`` or ``paged-sparse-attn bench``.

Suites
------
cpu
    The numpy backend against this machine's own ceilings (gather floor, matmul rate).
gpu
    Every available device backend on the MSA workload matrix, kernel times from GPU timestamp
    queries with the paged cache device-resident, end-to-end ``forward()`` time separately,
    ratios to the device copy bandwidth measured in the same run and, where torch with CUDA is
    importable, to peers (dense SDPA, gather+SDPA, FlexAttention) on the same problems.
index
    The index branch (block_scores + select_topk) against torch matmul + amax + topk.
layer
    What a model runs per layer, in wall time: a loop of layers through a plan (attention given
    the selection, and the whole MSA layer), pipelined and synchronised per call, ``forward()``
    with host arrays, beside the same loops in torch (:mod:`.layer`).

Numbers are measured, never assumed; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Callable, Sequence

__all__ = ["main", "run"]


def _progress() -> tuple[Callable[[str], None], Callable[[], None]]:
    """A status line (rich if installed, else plain prints)."""
    try:
        from rich.console import Console

        console = Console(stderr=True)
        status = console.status("starting")
        status.start()
        return (lambda s: status.update(s)), status.stop
    except Exception:
        return (lambda s: print(f"  .. {s}", file=sys.stderr, flush=True)), (lambda: None)


def run(suite: str = "cpu", *, quick: bool = False, backends: Sequence[str] | None = None,
        repeat: int | None = None, progress: Callable[[str], None] | None = None,
        on_row: Callable[[dict], None] | None = None, workloads: Sequence[str] | None = None) -> dict:
    """Run a suite and return a JSON-ready dict (see the module docstring).

    ``workloads``: names of the GPU suite's workloads to run (default: all of the suite); an
    unknown name raises ``ValueError`` listing the known ones.
    """
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), python=platform.python_version(),
                machine=platform.machine(), suite=suite, quick=quick)
    if suite == "cpu":
        from .cpu import CPU_WORKLOADS, QUICK_CPU_WORKLOADS, run_cpu

        res = run_cpu(QUICK_CPU_WORKLOADS if quick else CPU_WORKLOADS, repeat=repeat or (1 if quick else 5),
                      progress=progress)
    elif suite == "gpu":
        from .gpu import GPU_WORKLOADS, QUICK_GPU_WORKLOADS, run_gpu

        wls = None
        if workloads:
            known = {w.name: w for w in (*GPU_WORKLOADS, *QUICK_GPU_WORKLOADS)}
            bad = [n for n in workloads if n not in known]
            if bad:
                raise ValueError(f"bench: unknown workload(s) {bad}; the gpu suite has {sorted(known)}")
            wls = [known[n] for n in workloads]
        res = run_gpu(quick=quick, backends=backends, repeat=repeat, progress=progress, workloads=wls,
                      on_row=(lambda partial: on_row({**meta, **partial})) if on_row else None)
    elif suite == "index":
        from .index_branch import run_index

        res = run_index(quick=quick, backends=backends, repeat=repeat, progress=progress)
    elif suite == "layer":
        from .layer import run_layer

        res = run_layer(quick=quick, backends=backends, repeat=repeat, progress=progress)
    else:
        raise ValueError(f"unknown suite {suite!r} (cpu, gpu, index, layer)")
    return {**meta, **res}


def format_table(result: dict) -> str:
    """Plain-text table of a result."""
    rows = result.get("rows", [])
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    head = {k: v for k, v in result.items() if k != "rows" and not isinstance(v, (list, dict))}
    return "\n".join([json.dumps(head), *lines])


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    ap = argparse.ArgumentParser(prog="paged-sparse-attn bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=["cpu", "gpu", "index", "layer"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, one repeat (a smoke test)")
    ap.add_argument("--backend", action="append", help="device backends to run (default: every available)")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--workload", action="append", metavar="NAME",
                    help="gpu suite: run only this workload (repeatable; default: every workload)")
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON")
    ap.add_argument("--plot", metavar="PATH", help="draw a PNG plot (matplotlib)")
    a = ap.parse_args(argv)
    say, stop = _progress()

    def save(partial: dict) -> None:  # after every row: a run cut short keeps what it measured
        if a.json:
            with open(a.json, "w") as f:
                json.dump(partial, f, indent=1)

    try:
        if a.workload and a.suite != "gpu":
            ap.error("--workload applies to the gpu suite only")
        result = run(a.suite, quick=a.quick, backends=a.backend, repeat=a.repeat, progress=say, on_row=save,
                     workloads=a.workload)
    finally:
        stop()
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        from .plot import plot

        plot(result, a.plot)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
