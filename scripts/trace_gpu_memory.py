"""The GPU memory in use at every step of the ``gpu`` suite (torch's view of the device).

Runs ``bench.gpu.run_gpu`` on the named workloads and backends (repeat 5) with a progress hook
that prints the seconds since the start, the device memory in use (``torch.cuda.mem_get_info``)
and what torch's allocator holds, then each row's peer errors. Written to find what ran the
H200 out of memory in the prefill row's FlexAttention peer (its eager BlockMask builder).

    python scripts/trace_gpu_memory.py [--backend wgpu --backend dawn] [--workload prefill-f16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from paged_sparse_attn.bench.gpu import GPU_WORKLOADS, run_gpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append")
    ap.add_argument("--workload", action="append")
    a = ap.parse_args()
    names = a.workload or ["prefill-f16"]
    t0 = time.time()

    def say(step: str) -> None:
        free, total = torch.cuda.mem_get_info()
        print(f"{time.time() - t0:7.1f}s used {(total - free) / 2**30:6.1f} GiB (torch reserved "
              f"{torch.cuda.memory_reserved() / 2**30:5.1f}) | {step}", flush=True)

    r = run_gpu(backends=a.backend, workloads=[w for w in GPU_WORKLOADS if w.name in names], progress=say, repeat=5)
    say("done")
    for row in r["rows"]:
        print(row["workload"], {k: v for k, v in row.items() if "error" in k or k.endswith("FlexAttention bf16_s")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
