"""Experiment: how a decode ``forward()`` with host arrays follows the host's pace, process by
process, beside torch's calls and two probes of the host itself.

The same decode ``forward()`` took 367 to 759 µs in different processes on the same machine
(2026-12-03; ``experiment_forward_host_io.py --ab``), while the GPU's share stayed ~120 µs. This
script runs ``--processes`` fresh processes one after the other; each, on the bench's decode
layer workload (B = 32, L = 32k, one query each, Hq = 32, Hkv = 4, D = 128, top-16 of 128-token
blocks, float16 caches resident on the device) measures, in turn and ``--rounds`` times:

* ``py``: a pure-Python loop (no memory traffic beyond the cache), ns per iteration;
* ``copy``: numpy copying 512 KiB (the size of a decode ``q``) between two arrays, GB/s;
* ``forward``: ``forward()`` with numpy ``q`` and ``selected`` in and numpy ``out`` back,
  median µs over 64 calls (32 query sets in turn) on ``--backend``;
* ``torch``: torch's gather+SDPA on the same selection (bf16, the bench's peer), ``q`` on the
  GPU, a ``torch.cuda.synchronize()`` per call, median µs over 64 calls;
* ``torch host``: the same with ``q`` taken from numpy and ``out`` returned to numpy
  (``torch.as_tensor(q).cuda()`` ... ``.cpu().numpy()``), what a numpy caller of torch runs.

Each process prints one JSON line (medians over its rounds, and the CPU it ran on); the parent
prints a table and the correlation of ``forward`` with each probe.

    python scripts/experiment_host_pace.py [--processes 6] [--rounds 3] [--backend dawn] [--calls 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiment_forward_host_io import _cpu  # the CPU this thread last ran on


def _py_loop_ns(n: int = 200_000) -> float:
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    return (time.perf_counter() - t) / n * 1e9


def _copy_gbs(nbytes: int = 512 * 1024, reps: int = 200) -> float:
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(reps):
        np.copyto(b, a)
    return nbytes * reps / (time.perf_counter() - t) / 1e9


CALLS = 64


def _median_us(call, n: int | None = None) -> float:
    n = CALLS if n is None else n
    ts = []
    for i in range(n):
        t = time.perf_counter()
        call(i)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def one(backend: str, rounds: int, L: int | None = None) -> dict:
    import _layer_inputs as li

    import paged_sparse_attn as psa

    lw, prob, _, _ = li.layer_inputs("decode", shape=(1, L) if L else None)
    be = type(psa.get_backend(backend))()
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(32)]
    k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])

    def fwd(i):
        return psa.forward(qs[i % 32], k, v, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"],
                           used_kv_lens=prob["used_kv_lens"], block_size=lw.w.block_size, causal=lw.w.causal,
                           backend=be)

    torch_calls = None
    try:
        import torch

        from paged_sparse_attn.bench.peers import gather_sdpa_fn

        if torch.cuda.is_available():
            run, _ = gather_sdpa_fn(prob, "bfloat16")
            tq = [torch.as_tensor(q, device="cuda").to(torch.bfloat16) for q in qs]

            def synced(i):
                run(tq[i % 32])
                torch.cuda.synchronize()

            def host(i):
                q = torch.as_tensor(qs[i % 32]).to("cuda").to(torch.bfloat16)
                return run(q).float().cpu().numpy()

            torch_calls = (synced, host)
    except ImportError:
        pass
    fwd(0)  # warm: pipelines, plan, host memory
    if torch_calls:
        for f in torch_calls:
            f(0)
    res: dict = {"py": [], "copy": [], "forward": [], "torch": [], "torch host": [], "cpu": []}
    for _ in range(rounds):
        res["py"].append(_py_loop_ns())
        res["copy"].append(_copy_gbs())
        res["forward"].append(_median_us(fwd))
        if torch_calls:
            res["torch"].append(_median_us(torch_calls[0]))
            res["torch host"].append(_median_us(torch_calls[1]))
        res["cpu"].append(_cpu())
    k.release()
    v.release()
    out = {key: (round(float(np.median(val)), 2) if val and key != "cpu" else val) for key, val in res.items()}
    out["forward rounds"] = [round(x, 1) for x in res["forward"]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--calls", type=int, default=64, help="calls per round and measurement")
    ap.add_argument("--L", type=int, default=None, help="a shorter KV length (to try the script on a CPU driver)")
    ap.add_argument("--one", action="store_true", help="(internal) one process's measurement, as a JSON line")
    a = ap.parse_args()
    global CALLS  # the one setting of the measurement's call count
    CALLS = a.calls
    if a.one:
        print(json.dumps(one(a.backend, a.rounds, a.L)), flush=True)
        return 0
    rows = []
    for p in range(a.processes):
        cmd = [sys.executable, __file__, "--one", "--backend", a.backend, "--rounds", str(a.rounds),
               "--calls", str(a.calls)] + (["--L", str(a.L)] if a.L else [])
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)  # a failed process is reported
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode or not line:
            print(f"process {p}: failed (rc {r.returncode})\n{r.stderr[-2000:]}", flush=True)
            continue
        rows.append(json.loads(line[-1]))
        print(f"process {p}: {line[-1]}", flush=True)
    if not rows:
        return 1
    print(f"\n{'process':>7} {'CPUs':>12} {'py ns/it':>9} {'copy GB/s':>10} {'forward us':>11} "
          f"{'torch us':>9} {'torch host us':>14}")
    for p, r in enumerate(rows):
        print(f"{p:>7} {sorted(set(r['cpu']))!s:>12} {r['py']:>9.1f} {r['copy']:>10.1f} {r['forward']:>11.1f} "
              f"{r.get('torch') or float('nan'):>9.1f} {r.get('torch host') or float('nan'):>14.1f}")
    f = np.array([r["forward"] for r in rows])
    print(f"forward() <= 500 us in {int((f <= 500).sum())} of {len(f)} processes; "
          f"range {f.min():.0f}-{f.max():.0f} us")
    if len(rows) > 2:
        for key in ("py", "copy", "torch", "torch host"):
            x = np.array([r.get(key) or np.nan for r in rows], dtype=float)
            if np.isfinite(x).all() and x.std() > 0:
                print(f"correlation of forward() with {key}: {np.corrcoef(f, x)[0, 1]:+.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
