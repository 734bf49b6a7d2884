"""The layer suite: what a model runs per layer, timed as a user runs it, beside torch.

For each workload a loop of ``layers`` layers, each with its own ``q`` and ``index_q`` and the
same caches (resident on the device), is timed in wall time:

``attention`` (selection given)
    ours: ``AttentionPlan.run`` with device-resident q and selection, outputs left on the
    device, one synchronisation at the end (a pipelined model); torch: gather+SDPA on the GPU,
    one synchronisation at the end.
``attention, synced``
    the same with a synchronisation per layer.
``forward() numpy``
    ours only: ``forward()`` with host q and selection, host outputs (one call's latency);
    ``forward_numpy_f16_s`` the same with q as float16 (a float16 model's call: the planned
    path writes it as it is and widens it on the device, R7).
``layer`` (index branch + attention)
    ours: ``AttentionPlan.run_sparse`` (block scores, top-k with the local block, inversion,
    partials, combine in one submission); torch: matmul + amax + topk over the paged index keys,
    then gather+SDPA.
``layer, synced``
    the same with a synchronisation per layer.

A synchronisation waits for the device and copies nothing: ``backend.synchronize()`` (R35) for
ours, ``torch.cuda.synchronize()`` for torch. What a copy of one layer's ``out`` to the host
costs is kept apart (``readback_s``: ours ``out.numpy()``, torch ``out.cpu()``, each after a
synchronisation).

For the pipelined loops of ours the host time per layer is also kept (``attention_host_s``,
``layer_host_s``: until the last call returned, before the final synchronisation): equal to the
loop's time when the host is what the loop waits for, below it when the GPU is.

Kernel references from the same run: the partials+combine time of one call from GPU timestamps
(``profile_forward``'s ``call_s``), and the pass split of a plan's call (``gpu_index_s``,
``gpu_invert_s``, ``gpu_attention_s``) from a backend with ``timestamps=True``; torch's index
branch alone in GPU time (``index_gpu_s``, CUDA events: scores, mask, block maxima, local block,
top-k over index keys gathered beforehand), the peer of ``split_gpu_index_s``
(``speedup_vs_torch_index_gpu``). Nothing here asserts a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .. import registry
from .._attention_plan import plan_attention
from .workloads import Workload, make_problem

__all__ = ["LAYER_WORKLOADS", "QUICK_LAYER_WORKLOADS", "run_layer"]


@dataclass(frozen=True)
class LayerWorkload:
    """A workload of the layer suite: attention geometry, index dim and layers per loop."""

    w: Workload
    index_dim: int = 128
    layers: int = 32


LAYER_WORKLOADS = (
    LayerWorkload(Workload("decode", B=32, L=32768, Tq_per_seq=1)),
    LayerWorkload(Workload("prefill", B=1, L=32768, Tq_per_seq=4096), layers=8),
)
QUICK_LAYER_WORKLOADS = (
    LayerWorkload(Workload("decode-quick", B=4, L=1024, Tq_per_seq=1, Hq=8, Hkv=2, D=32, page_size=16,
                           block_size=32, topk=4, dtype="float32"), index_dim=16, layers=4),
)


def _loop_time(step: Callable[[int], object], sync: Callable[[object], None], layers: int, repeat: int,
               per_call_sync: bool, issued: list | None = None) -> float:
    """Median wall seconds per layer of ``repeat`` loops of ``layers`` calls (after one warm loop).

    ``issued``: receives the median seconds per layer until the last call returned, before the
    final synchronisation (a pipelined loop's host time per layer: below the wall time when the
    GPU is what the loop waits for, equal to it when the host is)."""
    times, issue = [], []
    for r in range(repeat + 1):
        t0 = time.perf_counter()
        last = None
        for i in range(layers):
            last = step(i)
            if per_call_sync:
                sync(last)
        t1 = time.perf_counter()
        if not per_call_sync:
            sync(last)
        if r:
            times.append((time.perf_counter() - t0) / layers)
            issue.append((t1 - t0) / layers)
    if issued is not None:
        issued.append(float(np.median(issue)))
    return float(np.median(times))


def _readback_time(call: Callable[[], object], sync: Callable[[object], None],
                   read: Callable[[object], object], repeat: int) -> float:
    """Median wall seconds of ``read(out)``, the copy of one call's finished output to the host."""
    times = []
    for _ in range(max(3, repeat)):
        out = call()
        sync(out)
        t0 = time.perf_counter()
        read(out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _index_inputs(lw: LayerWorkload, prob: dict, seed: int):
    rng = np.random.default_rng(seed)
    w = lw.w
    Tq = prob["q"].shape[0]
    P, _, S, _ = prob["k_cache"].shape
    iqs = [rng.standard_normal((Tq, w.Hkv, lw.index_dim), dtype=np.float32) for _ in range(lw.layers)]
    ik = rng.standard_normal((P, 1, S, lw.index_dim), dtype=np.float32).astype(w.dtype)
    return iqs, ik


def _plan(be, lw: LayerWorkload, prob: dict):
    """The workload's plan on ``be``: attention and the index branch (one shared index key head)."""
    w = lw.w
    return plan_attention(prob["block_tables"], prob["cu_seqlens_q"], prob["used_kv_lens"], block_size=w.block_size,
                          page_size=w.page_size, num_q_heads=w.Hq, num_kv_heads=w.Hkv, head_dim=w.D,
                          kv_dtype=w.dtype, topk=w.topk, causal=w.causal, index_dim=lw.index_dim, num_index_heads=1,
                          index_dtype=w.dtype, backend=be)


def _ours(be, lw: LayerWorkload, prob: dict, qs, iqs, ik, repeat: int) -> dict:
    w = lw.w
    kd, vd = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
    ikd = be.upload_index_cache(ik)
    plan = _plan(be, lw, prob)
    qd = [be.asarray(q) for q in qs]
    iqd = [be.asarray(iq) for iq in iqs]
    sd = be.asarray(prob["selected"])
    row = dict(kernel=plan._runtime.geometry.get("kernel") if hasattr(plan._runtime, "geometry") else None)

    def sync(_):
        be.synchronize()  # R35: waits, copies nothing (torch: torch.cuda.synchronize())

    att = lambda i: plan.run(qd[i], kd, vd, sd)  # noqa: E731
    lay = lambda i: plan.run_sparse(qd[i], kd, vd, iqd[i], ikd)  # noqa: E731
    L = lw.layers
    issued: list = []
    row["attention_s"] = _loop_time(att, sync, L, repeat, False, issued)
    row["attention_synced_s"] = _loop_time(att, sync, L, repeat, True)
    row["layer_s"] = _loop_time(lay, sync, L, repeat, False, issued)
    row["layer_synced_s"] = _loop_time(lay, sync, L, repeat, True)
    row["attention_host_s"], row["layer_host_s"] = issued
    row["readback_s"] = _readback_time(lambda: att(0), sync, lambda out: out.numpy(), repeat)
    fargs = dict(used_kv_lens=prob["used_kv_lens"], block_size=w.block_size, causal=w.causal, backend=be)

    def forward_loop(queries) -> float:
        """``forward()`` with host arrays, layer ``i`` on ``queries[i]``: seconds per call."""
        import paged_sparse_attn as psa

        return _loop_time(lambda i: psa.forward(queries[i], kd, vd, prob["block_tables"], prob["selected"],
                                                prob["cu_seqlens_q"], **fargs), lambda r: None, L, repeat, True)

    row["forward_numpy_s"] = forward_loop(qs)
    # where a forward() call's time goes: inside the plan runtime (encode, submit, GPU wait and
    # readback) and before it (validation, plan lookup): the wall time minus the runtime's total
    t = dict(be.last_timings)
    for k in ("encode_s", "submit_s", "wait_readback_s", "total_s"):
        if k in t:
            row[f"forward_{k}"] = t[k]
    row["forward_numpy_f16_s"] = forward_loop([q.astype(np.float16) for q in qs])
    # the pass split of one call, from GPU timestamps (a second device of the same adapter)
    try:
        tb = type(be)(timestamps=True)
        kt, vt = tb.upload_kv_cache(prob["k_cache"], prob["v_cache"])
        ikt = tb.upload_index_cache(ik)
        pt = _plan(tb, lw, prob)
        splits = []
        for i in range(max(5, repeat)):
            pt.run_sparse(qs[i % L], kt, vt, iqs[i % L], ikt)
            splits.append(dict(tb.last_timings))
        for k in ("gpu_index_s", "gpu_scores_s", "gpu_topk_s", "gpu_invert_s", "gpu_attention_s", "gpu_total_s",
                  "encode_s", "wait_readback_s"):
            vals = [s[k] for s in splits[1:] if k in s]
            if vals:
                row[f"split_{k}"] = float(np.median(vals))
        # partials + combine of the same call, steady state (replayed), as the gpu suite times it
        import paged_sparse_attn as psa

        from .._validation import validate_forward

        p = validate_forward("bench", qs[0], kt, vt, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"],
                             used_kv_lens=prob["used_kv_lens"], block_size=w.block_size, softmax_scale=None,
                             causal=w.causal)
        ix = psa.build_kvouter_index(prob["selected"], prob["block_tables"], prob["cu_seqlens_q"],
                                     prob["used_kv_lens"], block_size=w.block_size, page_size=w.page_size,
                                     causal=w.causal)
        prof = tb.profile_forward(p, ix, repeat=repeat, replay="auto", warmup_s=0.5)
        row["kernel_call_s"] = prof.get("call_s")
        tb.close()
    except Exception as exc:  # a device without timestamps: the row says why
        row["split_error"] = f"{type(exc).__name__}: {exc}"
    for a in (kd, vd, ikd):
        a.release()
    plan.close()
    return row


def _torch(lw: LayerWorkload, prob: dict, qs, iqs, ik, repeat: int) -> dict:
    """torch on the same problem: gather+SDPA given the selection, and the whole layer."""
    import torch

    from .peers import _dev, cuda_time, gather_sdpa_fn

    dev = _dev()
    w = lw.w
    run, _ = gather_sdpa_fn(prob, "bfloat16")
    tq = [torch.as_tensor(q, device=dev).to(torch.bfloat16) for q in qs]
    tiq = [torch.as_tensor(iq, device=dev).to(torch.bfloat16) for iq in iqs]
    bt = torch.as_tensor(prob["block_tables"], device=dev).long()
    cu = np.asarray(prob["cu_seqlens_q"])
    B, T = bt.shape[0], w.Tq_per_seq
    S, BS, L = w.page_size, w.block_size, int(prob["used_kv_lens"][0])
    nblk = -(-L // BS)
    ikt = torch.as_tensor(ik, device=dev).to(torch.bfloat16)  # [P, 1, S, d]
    Tq = qs[0].shape[0]
    i = torch.arange(T, device=dev)
    limit = (L - T + i) if w.causal else torch.full((T,), L - 1, device=dev)
    pos = torch.arange(nblk * BS, device=dev)
    masked = (pos[None, :] > limit[:, None]) | (pos[None, :] >= L)  # [T, nblk*BS]
    local = (limit // BS).clamp(max=nblk - 1)  # [T]
    kvh, Hq, D = w.Hkv, w.Hq, w.D
    G = Hq // kvh
    kc = torch.as_tensor(prob["k_cache"], device=dev).to(torch.bfloat16)
    vc = torch.as_tensor(prob["v_cache"], device=dev).to(torch.bfloat16)
    ppb = BS // S
    K = min(w.topk, nblk)
    seq = torch.as_tensor(np.repeat(np.arange(B), np.diff(cu)), device=dev)
    heads = torch.arange(kvh, device=dev)[None, :, None, None]
    scale = lw.index_dim ** -0.5

    def layer(j):
        keys = ikt[bt[:, :nblk * ppb]].reshape(B, nblk * BS, -1)  # gather the paged index keys [B, nblk*BS, d]
        s = torch.einsum("bthd,bld->bthl", tiq[j].view(B, T, kvh, -1), keys) * scale
        s = s.masked_fill(masked[None, :, None, :], float("-inf"))
        blk = s.view(B, T, kvh, nblk, BS).amax(-1)
        blk.scatter_(-1, local[None, :, None, None].expand(B, T, kvh, 1), float("inf"))  # the local block first
        top = torch.topk(blk, K, dim=-1).indices.view(Tq, kvh, K)
        pages = bt[seq[:, None, None, None], top[..., None] * ppb + torch.arange(ppb, device=dev)]
        kk = kc[pages, heads].reshape(Tq, kvh, K * BS, D)
        vv = vc[pages, heads].reshape(Tq, kvh, K * BS, D)
        return torch.nn.functional.scaled_dot_product_attention(tq[j].view(Tq, kvh, G, D), kk, vv)

    def sync(_):
        if dev != "cpu":
            torch.cuda.synchronize()

    # the index branch alone, GPU time (CUDA events, as the index suite's peer): the layer's
    # scores, mask, block maxima, local block and top-k, from index keys gathered beforehand
    # (torch's gather of the paged keys left out: the stricter comparison)
    keys0 = ikt[bt[:, :nblk * ppb]].reshape(B, nblk * BS, -1)

    def index_only():
        s = torch.einsum("bthd,bld->bthl", tiq[0].view(B, T, kvh, -1), keys0) * scale
        s = s.masked_fill(masked[None, :, None, :], float("-inf"))
        blk = s.view(B, T, kvh, nblk, BS).amax(-1)
        blk.scatter_(-1, local[None, :, None, None].expand(B, T, kvh, 1), float("inf"))
        return torch.topk(blk, K, dim=-1).indices

    n = lw.layers
    row = dict(attention_s=_loop_time(lambda j: run(tq[j]), sync, n, repeat, False),
               attention_synced_s=_loop_time(lambda j: run(tq[j]), sync, n, repeat, True),
               layer_s=_loop_time(layer, sync, n, repeat, False),
               layer_synced_s=_loop_time(layer, sync, n, repeat, True))
    row["readback_s"] = _readback_time(lambda: run(tq[0]), sync, lambda out: out.cpu(), repeat)
    try:
        row["index_gpu_s"] = cuda_time(index_only, max(repeat, 10))
    except Exception as exc:  # noqa: BLE001 -- the loops above stand without it
        row["index_error"] = f"{type(exc).__name__}: {exc}"
    return row


def run_layer(*, quick: bool = False, backends: Sequence[str] | None = None, repeat: int | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Run the layer suite on the device backends (and torch where importable); see the module doc."""
    from .peers import torch_available

    say = progress or (lambda s: None)
    reps = repeat or (2 if quick else 5)
    names = backends or [n for n, av in registry.list_backends().items() if av.ok and n != "numpy"]
    rows = []
    torch_ok, torch_why = torch_available()
    for lw in (QUICK_LAYER_WORKLOADS if quick else LAYER_WORKLOADS):
        w = lw.w
        say(f"layer: building {w.name}")
        prob = make_problem(w, seed=1, fill="selected")
        rng = np.random.default_rng(2)
        qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(lw.layers)]
        iqs, ik = _index_inputs(lw, prob, 3)
        for name in names:
            say(f"layer: {w.name} on {name}")
            be = registry.get_backend(name)
            if not hasattr(be, "upload_kv_cache") or not be.capabilities.device_arrays:
                continue
            rows.append(dict(workload=w.name, impl=name, layers=lw.layers, **_ours(be, lw, prob, qs, iqs, ik, reps)))
        if torch_ok:
            say(f"layer: {w.name} on torch")
            try:
                rows.append(dict(workload=w.name, impl="torch bf16", layers=lw.layers,
                                 **_torch(lw, prob, qs, iqs, ik, reps)))
            except Exception as exc:  # e.g. out of memory on a small GPU: the row says so
                rows.append(dict(workload=w.name, impl="torch bf16", error=f"{type(exc).__name__}: {exc}"))
    _ratios(rows)
    return dict(rows=rows, torch=torch_why)


def _ratios(rows: list[dict]) -> None:
    """Per workload: torch time / ours for each loop, and ours against its kernel time."""
    for r in rows:
        if r.get("impl", "").startswith("torch"):
            continue
        peer = next((x for x in rows if x["workload"] == r["workload"] and x.get("impl", "").startswith("torch")
                     and "error" not in x), None)
        if peer:
            for k in ("attention_s", "attention_synced_s", "layer_s", "layer_synced_s", "readback_s"):
                if r.get(k) and peer.get(k):
                    r[f"speedup_vs_torch_{k[:-2]}"] = peer[k] / r[k]
            if r.get("split_gpu_index_s") and peer.get("index_gpu_s"):
                r["speedup_vs_torch_index_gpu"] = peer["index_gpu_s"] / r["split_gpu_index_s"]
        if r.get("kernel_call_s") and r.get("attention_s"):
            r["attention_over_kernel"] = r["attention_s"] / r["kernel_call_s"]
