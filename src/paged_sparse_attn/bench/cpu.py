"""CPU measurements of the numpy backend against this machine's own ceilings.

Reports, measured in one run: forward() time; the time numpy needs just to gather the K/V rows
the problem needs, once (the memory floor); the float32 matmul rate on a 1024^3 product; the
FLOP rate forward() achieves; the share of forward() spent building the KV-outer index.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .._api import forward
from .._index import build_index_arrays
from .._types import SeqLayout
from .._validation import validate_forward
from .workloads import Workload, make_problem, needed_kv_bytes

__all__ = ["CPU_WORKLOADS", "QUICK_CPU_WORKLOADS", "attention_flops", "gather_floor", "matmul_gflops", "run_cpu"]

CPU_WORKLOADS = (
    Workload("cpu-decode", B=16, L=16384, Tq_per_seq=1, page_size=16, block_size=64, dtype="float32"),
    Workload("cpu-prefill", B=2, L=8192, Tq_per_seq=256, page_size=16, block_size=64, dtype="float32"),
)

# a smoke-test size of the same geometry (CI runs it without timing assertions)
QUICK_CPU_WORKLOADS = (
    Workload("cpu-decode-quick", B=2, L=1024, Tq_per_seq=1, page_size=16, block_size=64, dtype="float32"),
    Workload("cpu-prefill-quick", B=1, L=1024, Tq_per_seq=32, page_size=16, block_size=64, dtype="float32"),
)


def best_of(fn: Callable[[], object], repeat: int = 5, min_time: float = 0.0) -> float:
    """Best wall time of ``repeat`` calls (after one warm-up call), in seconds."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_gflops(n: int = 1024, repeat: int = 5) -> float:
    """This machine's numpy float32 matmul rate on an n^3 product, GFLOP/s."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    return 2 * n**3 / best_of(lambda: a @ b, repeat) / 1e9


def attention_flops(problem: dict) -> int:
    """FLOPs of the attended work: 4 * D per (query head, attended position) (QK^T and PV)."""
    p = validate_forward("bench", **{k: problem[k] for k in ("q", "k_cache", "v_cache", "block_tables", "selected", "cu_seqlens_q")},
                         used_kv_lens=problem["used_kv_lens"], block_size=problem["block_size"], softmax_scale=None,
                         causal=problem["causal"])
    idx = build_index_arrays(p.selected, p.layout)
    ppb = p.block_size // p.page_size
    pages = p.block_tables[idx.edge_seq[:, None], idx.edge_block[:, None] * ppb + np.arange(ppb)]
    mapped = np.repeat(pages >= 0, p.page_size, axis=1)
    attended = (mapped & (np.arange(p.block_size)[None, :] < idx.edge_len[:, None])).sum()
    return int(4 * p.head_dim * p.group_size * attended)


def gather_floor(problem: dict, repeat: int = 5) -> float:
    """Seconds numpy needs to gather every needed K and V block once (fancy indexing)."""
    sel, cu, bt = problem["selected"], problem["cu_seqlens_q"], problem["block_tables"]
    kc, vc = problem["k_cache"], problem["v_cache"]
    S, BS = kc.shape[2], problem["block_size"]
    ppb = BS // S
    msb = bt.shape[1] // ppb
    Hkv = kc.shape[1]
    b = np.repeat(np.arange(bt.shape[0]), np.diff(cu))
    t, h, r = np.nonzero(sel >= 0)
    keys = np.unique((b[t].astype(np.int64) * Hkv + h) * msb + sel[t, h, r])
    bb, hh, ss = keys // (Hkv * msb), (keys // msb) % Hkv, keys % msb
    pages = bt[bb[:, None], ss[:, None] * ppb + np.arange(ppb)]

    def gather():
        return kc[pages, hh[:, None]], vc[pages, hh[:, None]]

    return best_of(gather, repeat)


def run_cpu(workloads=CPU_WORKLOADS, repeat: int = 5, progress: Callable[[str], None] | None = None) -> dict:
    """Measure every workload on the numpy backend; returns a JSON-ready dict."""
    say = progress or (lambda s: None)
    say("matmul rate")
    rate = matmul_gflops(repeat=repeat)
    rows = []
    for w in workloads:
        say(f"{w.name}: building problem")
        prob = make_problem(w)
        args = {k: prob[k] for k in ("q", "k_cache", "v_cache", "block_tables", "selected", "cu_seqlens_q")}
        kw = dict(used_kv_lens=prob["used_kv_lens"], block_size=prob["block_size"], causal=prob["causal"])
        say(f"{w.name}: forward")
        t_fwd = best_of(lambda: forward(*args.values(), backend="numpy", **kw), repeat)
        sel32 = np.ascontiguousarray(prob["selected"], np.int32)
        seqs = SeqLayout(prob["block_tables"], prob["cu_seqlens_q"], prob["used_kv_lens"], w.block_size,
                         w.page_size, w.causal)
        t_idx = best_of(lambda: build_index_arrays(sel32, seqs), repeat)
        say(f"{w.name}: gather floor")
        t_gather = gather_floor(prob, repeat)
        flops = attention_flops(prob)
        rows.append(dict(
            workload=w.name, B=w.B, L=w.L, Tq=w.B * w.Tq_per_seq, forward_s=t_fwd, gather_floor_s=t_gather,
            forward_over_gather=t_fwd / t_gather, needed_kv_bytes=needed_kv_bytes(prob),
            flops=flops, forward_gflops=flops / t_fwd / 1e9, matmul_share=flops / t_fwd / 1e9 / rate,
            index_build_s=t_idx, index_share=t_idx / t_fwd,
        ))
    return dict(matmul_gflops=rate, rows=rows)
