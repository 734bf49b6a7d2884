"""Where the time of the index branch's two public calls goes, with host arrays.

The ``index`` suite's problem (MSA prefill: L = 32k, the last 4096 queries, one shared index key
head, block 128, top-16; the index key cache device-resident): ``block_scores()`` then
``select_topk()`` on one backend, their wall times per call (three calls after a warm-up), then a
cProfile of five more pairs (the functions with the most cumulative time, then the most time of
their own).

    python scripts/profile_index_calls.py [--backend dawn] [--L 32768] [--Tq 4096]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn import registry
from paged_sparse_attn.bench.index_branch import _problem
from paged_sparse_attn.index_branch import block_scores, select_topk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dawn")
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--Tq", type=int, default=4096)
    a = ap.parse_args()
    p = _problem(a.L, a.Tq)
    be = registry.get_backend(a.backend)
    args = dict(p, index_k_cache=be.upload_index_cache(p["index_k_cache"]))

    def scores():
        return block_scores(args["index_q"], args["index_k_cache"], args["block_tables"], args["cu_seqlens_q"],
                            args["used_kv_lens"], block_size=args["block_size"], causal=True, backend=be)

    def topk(sc):
        return select_topk(sc, 16, force_local=True, cu_seqlens_q=args["cu_seqlens_q"],
                           used_kv_lens=args["used_kv_lens"], block_size=args["block_size"], backend=be)

    topk(scores())
    for _ in range(3):
        t0 = time.perf_counter()
        sc = scores()
        t1 = time.perf_counter()
        topk(sc)
        t2 = time.perf_counter()
        print(f"{a.backend}: block_scores {1e3 * (t1 - t0):.2f} ms, select_topk {1e3 * (t2 - t1):.2f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        topk(scores())
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
