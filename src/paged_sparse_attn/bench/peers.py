"""Peers measured on the same problems, when torch (with a GPU) is importable.

Each function takes the problem dict of :func:`~paged_sparse_attn.bench.workloads.make_problem`
and returns seconds per call measured with CUDA events (median of ``repeat`` after warm-up).
All peers compute attention over the same query heads; the dense ones over the full causal KV.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["torch_available", "cuda_time", "copy_bandwidth", "gather_sdpa_fn", "PEERS"]


def _dev() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_available() -> tuple[bool, str]:
    """Whether torch can be used for peers (on CUDA when present, else on the CPU), and why not."""
    try:
        import torch  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return False, f"torch not importable ({exc.__class__.__name__})"
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return True, f"torch {torch.__version__} on {where}"


def cuda_time(fn: Callable[[], Any], repeat: int = 20, warmup_s: float = 0.3) -> float:
    """Median seconds of ``fn``: CUDA events on a GPU, wall time on the CPU.

    The steady-state protocol of the GPU suite, the same for every implementation: calls run
    back to back for at least ``warmup_s`` first (GPU clocks rise only under sustained load;
    a GPU that idles between calls times its kernels at idle clocks), then ``repeat`` calls are
    issued back to back with an event pair around each and one synchronisation at the end.
    """
    import time

    import torch

    fn()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < warmup_s or n < 3:
        fn()
        n += 1
        if _dev() != "cpu" and n % 4 == 0:
            torch.cuda.synchronize()  # keep the queue short: the warm-up is measured in wall time
    times = []
    if _dev() == "cpu":
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) / 1e3 for a, b in events]
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 1 << 31, repeat: int = 10) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=_dev())
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), repeat)
    return 2 * nbytes / t


def matmul_rate(size: int = 4096, repeat: int = 20, n: int | None = None, k: int | None = None) -> float:
    """FLOP/s of torch's bf16 matmul ``[size, k] x [k, n]`` (both ``size`` unless given) on this
    GPU, by CUDA events."""
    import torch

    n = size if n is None else n
    k = size if k is None else k
    a = torch.randn(size, k, device=_dev(), dtype=torch.bfloat16)
    b = torch.randn(k, n, device=_dev(), dtype=torch.bfloat16)
    t = cuda_time(lambda: torch.matmul(a, b), repeat)
    return 2.0 * size * n * k / t


def _on_device(problem, torch, dtype):
    """q, k_cache and v_cache of ``problem`` as torch tensors of ``dtype`` on the peer device."""
    return tuple(torch.as_tensor(problem[k], device=_dev()).to(dtype) for k in ("q", "k_cache", "v_cache"))


def _queries_dense(problem, torch, dtype):
    """Per sequence: q [1, Hq, T, D], full K/V [1, Hkv, L, D] (pages resolved), causal mask."""
    q, kc, vc = _on_device(problem, torch, dtype)
    bt = np.asarray(problem["block_tables"])
    cu = np.asarray(problem["cu_seqlens_q"])
    lens = np.asarray(problem["used_kv_lens"])
    seqs = []
    for b in range(bt.shape[0]):
        L = int(lens[b])
        S = kc.shape[2]
        pages = torch.as_tensor(bt[b, : -(-L // S)], device=_dev(), dtype=torch.long)
        k = kc[pages].permute(1, 0, 2, 3).reshape(kc.shape[1], -1, kc.shape[3])[:, :L][None]
        v = vc[pages].permute(1, 0, 2, 3).reshape(vc.shape[1], -1, vc.shape[3])[:, :L][None]
        qb = q[cu[b]:cu[b + 1]].permute(1, 0, 2)[None]
        seqs.append((qb, k.contiguous(), v.contiguous(), L))
    return seqs


def dense_sdpa(problem: dict, dtype_name: str = "bfloat16", repeat: int = 20) -> float:
    """torch SDPA over the full KV of every sequence (GQA), right-aligned causal via a bool mask.

    The mask is only needed when a sequence has more than one query (prefill); decode with one
    query per sequence attends everything. Sequences of equal shape are batched.
    """
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype_name)
    seqs = _queries_dense(problem, torch, dt)
    T, L = seqs[0][0].shape[2], seqs[0][3]
    q = torch.cat([s[0] for s in seqs]); k = torch.cat([s[1] for s in seqs]); v = torch.cat([s[2] for s in seqs])
    mask = None
    if problem["causal"] and T > 1:
        i = torch.arange(T, device=_dev())[:, None]
        p = torch.arange(L, device=_dev())[None, :]
        mask = p <= (L - T + i)
    return cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), repeat)


def gather_sdpa_fn(problem: dict, dtype_name: str = "bfloat16"):
    """torch gather+SDPA of ``problem``'s selection as a callable ``run(q)`` (q [Tq, Hq, D] on the
    peer device), and the problem's q there: the gather of the selected blocks' pages of every
    (query, KV head), then SDPA per query, both on the GPU."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype_name)
    q, kc, vc = _on_device(problem, torch, dt)
    sel = np.asarray(problem["selected"])
    bt = np.asarray(problem["block_tables"])
    cu = np.asarray(problem["cu_seqlens_q"])
    P, Hkv, S, D = kc.shape
    BS = problem["block_size"]
    ppb = BS // S
    Tq, _, K = sel.shape
    b = np.repeat(np.arange(bt.shape[0]), np.diff(cu))
    s = np.where(sel >= 0, sel, 0)
    pages = bt[b[:, None, None, None], s[..., None] * ppb + np.arange(ppb)]  # [Tq, Hkv, K, ppb]
    pages = torch.as_tensor(np.where(pages >= 0, pages, 0), device=_dev(), dtype=torch.long)
    heads = torch.arange(Hkv, device=_dev())[None, :, None, None].expand_as(pages)
    valid = torch.as_tensor(np.repeat((sel >= 0)[..., None], ppb * S, -1).reshape(Tq, Hkv, -1), device=_dev())
    G = q.shape[1] // Hkv

    def run(qq):
        k = kc[pages, heads].reshape(Tq, Hkv, K * BS, D)  # gather [Tq, Hkv, K*BS, D]
        v = vc[pages, heads].reshape(Tq, Hkv, K * BS, D)
        return F.scaled_dot_product_attention(qq.view(Tq, Hkv, G, D), k, v, attn_mask=valid[:, :, None, :])

    return run, q


def gather_sdpa(problem: dict, dtype_name: str = "bfloat16", repeat: int = 20) -> float:
    """torch: gather the selected blocks' pages of every (query, KV head), then SDPA per query.

    Decode-shaped: one query per sequence; the gathered K/V is [Tq, Hkv, topk*BS, D]. Timed:
    the gather (index_select over pages) plus SDPA, both on the GPU (:func:`gather_sdpa_fn`).
    """
    run, q = gather_sdpa_fn(problem, dtype_name)
    return cuda_time(lambda: run(q), repeat)


def flex_blockmask(problem: dict, dtype_name: str = "bfloat16", repeat: int = 10) -> float:
    """torch FlexAttention with a BlockMask built from the same selection.

    Sequences (equal T and L in the bench workloads) are batched over dense, contiguous K/V
    (pages resolved). The mask_mod allows position p for query t iff block p // BS is in
    ``selected[t, h]`` and p obeys right-aligned causal. Compiled once; the timed calls exclude
    compilation and BlockMask construction.
    """
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dt = getattr(torch, dtype_name)
    seqs = _queries_dense(problem, torch, dt)
    q = torch.cat([s[0] for s in seqs]); k = torch.cat([s[1] for s in seqs]); v = torch.cat([s[2] for s in seqs])
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BS = problem["block_size"]
    nblk = -(-L // BS)
    sel = np.asarray(problem["selected"]).reshape(B, T, Hkv, -1)
    allow = np.zeros((B, T, Hkv, nblk), dtype=bool)
    b_, t_, h_, r_ = np.nonzero(sel >= 0)
    allow[b_, t_, h_, sel[b_, t_, h_, r_]] = True
    allow_t = torch.as_tensor(allow, device=_dev())
    off = L - T
    causal = bool(problem["causal"])

    def mask_mod(bi, hi, qi, ki):
        ok = allow_t[bi, qi, hi // G, ki // BS]
        return ok & (ki <= qi + off) if causal else ok

    # built by torch's compiled builder, tile by tile: the eager builder evaluates mask_mod over the
    # dense [B, Hq, T, L] grid (the prefill's 4.3 G positions, with index temporaries), which ran
    # out of the H200's 140 GB in the gpu suite (2026-12-04)
    import inspect

    compiled = {"_compile": True} if "_compile" in inspect.signature(create_block_mask).parameters else {}
    bm = create_block_mask(mask_mod, B=B, H=Hq, Q_LEN=T, KV_LEN=L, device=_dev(), **compiled)
    flex = torch.compile(flex_attention, dynamic=False)
    return cuda_time(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True), repeat)


PEERS = {
    "torch dense SDPA bf16": lambda p: dense_sdpa(p, "bfloat16"),
    "torch dense SDPA f32": lambda p: dense_sdpa(p, "float32"),
    "torch gather+SDPA bf16": lambda p: gather_sdpa(p, "bfloat16"),
    "torch FlexAttention bf16": lambda p: flex_blockmask(p, "bfloat16"),
}
