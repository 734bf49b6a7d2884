"""The GPU suite: device backends on the MSA workload matrix, with ceilings and peers.

Per workload and implementation the row reports seconds per call, the effective bandwidth on
the K/V bytes the problem needs (``needed_kv_bytes``), the achieved FLOP rate on the attended
work, and ratios: ``floor_s / time`` (share of the memory floor, where the floor is needed bytes
over the copy bandwidth measured in this run) and ``peer_s / time`` for every peer. Backends
whose ``profile_forward`` takes a ``kernel=`` override (wgpu) report, on decode-like workloads
(one query per sequence), ``<backend>[generic]_s`` as well: the same call with the generic
partials kernel, next to ``<backend>_s`` (the automatic choice, named in ``<backend>_kernel``).

Every time is taken at steady state, the same way for every implementation: after a warm-up of
back-to-back calls, with the calls (or, for wgpu, a call's passes) issued back to back. A GPU
that idles between calls runs at its idle clock (an H200: 345 MHz instead of 1980), so timing
calls separated by host work times the idle clock. The SM clock and power sampled during each
measurement are in the row (``<name>_clocks``, where ``nvidia-smi`` exists). The floor's
bandwidth is the largest measured in the run: the copy bandwidth (bytes read plus written) of
each backend and of torch, and the backends' streaming read (``read_bandwidth``).
"""

from __future__ import annotations

import inspect
import time
from typing import Callable, Sequence

import numpy as np

from .. import registry
from .._api import forward
from .._index import build_index_arrays
from .._validation import validate_forward
from .clocks import ClockSampler
from .cpu import attention_flops
from .peers import PEERS, copy_bandwidth, torch_available
from .peers import matmul_rate as torch_matmul_rate
from .workloads import Workload, make_problem, needed_kv_bytes

__all__ = ["GPU_WORKLOADS", "QUICK_GPU_WORKLOADS", "run_gpu"]

# the matmul ceiling's square shape, ours and torch's: a multiple of every block of
# GEMM_VARIANTS (256 rows or columns, K steps up to 64 and of 48)
GEMM_SIZE = 4608
MSA = dict(Hq=32, Hkv=4, D=128, page_size=64, block_size=128, topk=16)

GPU_WORKLOADS = (
    Workload("decode-f16", B=32, L=32768, Tq_per_seq=1, dtype="float16", **MSA),
    Workload("decode-f32", B=32, L=32768, Tq_per_seq=1, dtype="float32", **MSA),
    Workload("prefill-f16", B=1, L=32768, Tq_per_seq=4096, dtype="float16", **MSA),
    # sweeps around the decode point, one axis at a time
    *(Workload(f"sweep-L{L // 1024}k-B8-G8", B=8, L=L, Tq_per_seq=1, dtype="float16", **MSA)
      for L in (2048, 8192, 32768, 131072)),
    *(Workload(f"sweep-L32k-B{B}-G8", B=B, L=32768, Tq_per_seq=1, dtype="float16", **MSA) for B in (1, 64)),
    *(Workload(f"sweep-L32k-B8-G{G}", B=8, L=32768, Tq_per_seq=1, dtype="float16",
               **{**MSA, "Hq": 4 * G}) for G in (1, 4, 16)),
)

QUICK_GPU_WORKLOADS = (
    Workload("decode-quick", B=2, L=2048, Tq_per_seq=1, dtype="float32", Hq=8, Hkv=2, D=64,
             page_size=16, block_size=64, topk=4),
    Workload("prefill-quick", B=1, L=1024, Tq_per_seq=64, dtype="float32", Hq=8, Hkv=2, D=64,
             page_size=16, block_size=64, topk=4),
)

# Peers per workload kind: the full matrix on the headline rows, the cheap ones on the sweep.
_PEERS_FOR = {
    "decode": ("torch dense SDPA bf16", "torch dense SDPA f32", "torch gather+SDPA bf16", "torch FlexAttention bf16"),
    "prefill": ("torch dense SDPA bf16", "torch FlexAttention bf16"),
    "sweep": ("torch dense SDPA bf16", "torch gather+SDPA bf16"),
}


def _kind(name: str) -> str:
    return name.split("-")[0]


def _wall(fn: Callable[[], object], repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _takes_kernel(be) -> bool:
    """Whether ``be.profile_forward`` accepts a ``kernel=`` override (the wgpu backend does)."""
    try:
        return "kernel" in inspect.signature(be.profile_forward).parameters
    except (TypeError, ValueError):
        return False


def _steady(be, quick: bool) -> dict:
    """Steady-state options of ``profile_forward`` where the backend takes them (wgpu): the
    passes of a call replayed back to back in one submission after a warm-up, so the GPU is
    timed busy, at the clocks it runs at under load (as the peers are: see ``peers.cuda_time``)."""
    try:
        params = inspect.signature(be.profile_forward).parameters
    except (TypeError, ValueError):
        return {}
    if "replay" not in params:
        return {}
    return dict(replay=2, warmup_s=0.0) if quick else dict(replay="auto", warmup_s=1.0)


def _device_backends(names: Sequence[str] | None) -> list:
    out = []
    avail = registry.list_backends()
    for name in names or [n for n in avail if n != "numpy"]:
        if not avail.get(name, None) or not avail[name].ok:
            continue
        be = registry.get_backend(name)
        if hasattr(be, "profile_forward") and hasattr(be, "upload_kv_cache"):
            out.append(be)
    return out


def run_gpu(*, quick: bool = False, backends: Sequence[str] | None = None, repeat: int | None = None,
            progress: Callable[[str], None] | None = None, workloads: Sequence[Workload] | None = None,
            on_row: Callable[[dict], None] | None = None) -> dict:
    """Run the GPU suite; returns ``dict(device=..., copy_bandwidth=..., rows=[...])``."""
    say = progress or (lambda s: None)
    repeat = repeat or (2 if quick else 20)
    wls = workloads or (QUICK_GPU_WORKLOADS if quick else GPU_WORKLOADS)
    bes = _device_backends(backends)
    t_ok, t_why = torch_available()
    result: dict = dict(backends=[b.name for b in bes], torch=t_why, ceilings={})
    if bes:
        result["device"] = bes[0].capabilities.device
    for be in bes:
        say(f"{be.name}: copy bandwidth")
        result["ceilings"][f"{be.name} copy bytes/s"] = be.copy_bandwidth(1 << (24 if quick else 30))
        result["ceilings"][f"{be.name} copy timer"] = getattr(be, "last_timings", {}).get("timer", "?")
        if hasattr(be, "read_bandwidth"):
            say(f"{be.name}: streaming read bandwidth")
            result["ceilings"][f"{be.name} read bytes/s"] = be.read_bandwidth(1 << (24 if quick else 30),
                                                                               warmup_s=0.0 if quick else 1.0)
        if hasattr(be, "matmul_rate") and "subgroup-matrix-f16-16x16x16" in be.capabilities.features:
            say(f"{be.name}: subgroup-matrix matmul rate")
            result["ceilings"][f"{be.name} matmul FLOP/s"] = be.matmul_rate(1024 if quick else GEMM_SIZE)
            result["ceilings"][f"{be.name} matmul"] = dict(be.last_timings)
            if hasattr(be, "robustness"):
                # the same GEMM variants with Dawn's bounds checks toggled: what the checks cost
                # the tensor cores (the backend runs without them by default: trusted kernels)
                other = not be.robustness
                label = "with bounds checks" if other else "no bounds checks"
                say(f"{be.name}: subgroup-matrix matmul rate {label}")
                twin = type(be)(robustness=other)
                try:
                    rate = twin.matmul_rate(1024 if quick else GEMM_SIZE)
                    result["ceilings"][f"{be.name} matmul FLOP/s, {label}"] = rate
                    result["ceilings"][f"{be.name} matmul, {label}"] = dict(twin.last_timings)
                finally:
                    twin.close()
    if t_ok:
        say("torch: copy bandwidth")
        result["ceilings"]["torch copy bytes/s"] = copy_bandwidth(1 << (24 if quick else 31))
        say("torch: bf16 matmul rate")
        result["ceilings"]["torch bf16 matmul FLOP/s"] = torch_matmul_rate(1024 if quick else GEMM_SIZE)
    bws = [v for k, v in result["ceilings"].items() if k.endswith("bytes/s") and v == v]
    bw = max(bws) if bws else None
    result["copy_bandwidth"] = bw
    rows = []
    peer_memo: dict = {}
    for w in wls:
        say(f"{w.name}: building the problem")
        prob = make_problem(w, fill="selected" if _kind(w.name) == "sweep" else "all")
        needed = needed_kv_bytes(prob)
        flops = attention_flops(prob)
        row = dict(workload=w.name, B=w.B, L=w.L, Tq=w.B * w.Tq_per_seq, G=w.G, dtype=w.dtype,
                   needed_MB=needed / 1e6, GFLOP=flops / 1e9)
        if bw:
            row["floor_s"] = needed / bw
        for be in bes:
            say(f"{w.name}: {be.name} upload")
            kd, vd = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
            args = dict(prob, k_cache=kd, v_cache=vd)
            p = validate_forward("bench", args["q"], kd, vd, args["block_tables"], args["selected"],
                                 args["cu_seqlens_q"], used_kv_lens=args["used_kv_lens"],
                                 block_size=args["block_size"], softmax_scale=None, causal=args["causal"])
            idx = build_index_arrays(p.selected, p.layout)
            say(f"{w.name}: {be.name} kernels")
            with ClockSampler() as clk:
                prof = be.profile_forward(p, idx, repeat=repeat, **_steady(be, quick))
            row[f"{be.name}_clocks"] = clk.summary()
            t = prof["total_s"]
            row[f"{be.name}_s"] = t
            row[f"{be.name}_partials_s"] = prof.get("partials_s")
            # the call's GPU work as forward() encodes it: one pass, no timestamps between kernels
            row[f"{be.name}_call_s"] = prof.get("call_s")
            row[f"{be.name}_combine_s"] = prof.get("combine_s")
            row[f"{be.name}_timer"] = prof.get("timer")
            row[f"{be.name}_GBps"] = needed / t / 1e9
            row[f"{be.name}_TFLOPs"] = flops / t / 1e12
            if prof.get("kernel"):
                row[f"{be.name}_kernel"] = prof["kernel"]
            if bw:
                row[f"{be.name}_floor_ratio"] = needed / bw / t
                if prof.get("call_s"):
                    row[f"{be.name}_call_floor_ratio"] = needed / bw / prof["call_s"]
            if w.Tq_per_seq == 1 and _takes_kernel(be):
                # decode-like: also time the generic partials kernel, next to the automatic choice
                say(f"{w.name}: {be.name} generic kernel")
                gen = be.profile_forward(p, idx, repeat=repeat, kernel="generic", **_steady(be, quick))
                row[f"{be.name}[generic]_s"] = gen["total_s"]
                row[f"{be.name}[generic]_partials_s"] = gen.get("partials_s")
                if bw:
                    row[f"{be.name}[generic]_floor_ratio"] = needed / bw / gen["total_s"]
            say(f"{w.name}: {be.name} forward() end to end")
            e2e = _wall(lambda: forward(**args, backend=be), max(2, repeat // 4))
            row[f"{be.name}_e2e_s"] = e2e
            row[f"{be.name}_overhead_x"] = (e2e - t) / t
            kd.release()
            vd.release()
        if t_ok:
            for peer in _PEERS_FOR[_kind(w.name) if _kind(w.name) in _PEERS_FOR else "decode"]:
                say(f"{w.name}: {peer}")
                # peers compute in their own dtypes: the f16 and f32 cache rows of one shape share them
                key = (peer, w.B, w.L, w.Tq_per_seq, w.Hq, w.Hkv, w.D, w.block_size, w.page_size, w.topk)
                try:
                    if key not in peer_memo:
                        with ClockSampler() as clk:
                            peer_memo[key] = (PEERS[peer](prob), clk.summary())
                    row[f"{peer}_s"], row[f"{peer}_clocks"] = peer_memo[key]
                except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
                    row[f"{peer}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                for be in bes:
                    if row.get(f"{peer}_s"):
                        row[f"{be.name}_speedup_vs_{peer}"] = row[f"{peer}_s"] / row[f"{be.name}_s"]
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rows.append(row)
        if on_row is not None:
            on_row(dict(result, rows=rows))
    result["rows"] = rows
    return result
