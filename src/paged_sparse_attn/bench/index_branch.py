"""The index-branch suite: block_scores + select_topk against torch (matmul + amax + topk).

MSA geometry: one index key head shared by the KV heads, block 128, page 64, top-k 16, the last
``Tq`` queries of one sequence with right-aligned causal. Our time is the wall time of the two
public calls with the index key cache device-resident (upload of the index queries and readback
of the selection included); torch's is CUDA-event time of the same work on the GPU, scores
materialised in bf16.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .. import registry
from ..index_branch import block_scores, select_topk
from .gpu import _wall
from .peers import cuda_time, torch_available

__all__ = ["INDEX_WORKLOADS", "run_index"]

INDEX_WORKLOADS = ((32768, 4096), (131072, 4096))
QUICK_INDEX_WORKLOADS = ((2048, 64),)


def _problem(L: int, Tq: int, *, Hkv=4, d=128, S=64, BS=128, seed=0):
    rng = np.random.default_rng(seed)
    P = -(-L // S)
    iq = rng.standard_normal((Tq, Hkv, d), dtype=np.float32)
    ik = rng.standard_normal((P, 1, S, d), dtype=np.float32).astype(np.float16)
    bt = rng.permutation(P).astype(np.int32)[None, :]
    return dict(index_q=iq, index_k_cache=ik, block_tables=bt, cu_seqlens_q=np.array([0, Tq], np.int32),
                used_kv_lens=np.array([L], np.int32), block_size=BS)


def torch_topk(p: dict, topk: int = 16, repeat: int = 10) -> float:
    """torch: scores = q·k over all L positions (bf16), causal mask, amax per block, topk."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L, Tq = int(p["used_kv_lens"][0]), p["index_q"].shape[0]
    BS = p["block_size"]
    ik = torch.as_tensor(p["index_k_cache"], device=dev)[torch.as_tensor(p["block_tables"][0], device=dev).long()]
    k = ik[:, 0].reshape(-1, ik.shape[-1])[:L].to(torch.bfloat16)  # [L, d]
    q = torch.as_tensor(p["index_q"], device=dev).to(torch.bfloat16)  # [Tq, Hkv, d]
    nblk = -(-L // BS)
    pos = torch.arange(nblk * BS, device=dev)
    limit = (L - Tq + torch.arange(Tq, device=dev))[:, None]
    masked = (pos[None, :] > limit) | (pos[None, :] >= L)  # [Tq, nblk*BS]
    scale = q.shape[-1] ** -0.5

    def run():
        s = torch.einsum("thd,ld->thl", q, k) * scale
        s = torch.nn.functional.pad(s, (0, nblk * BS - L), value=float("-inf"))
        s = s.masked_fill(masked[:, None, :], float("-inf"))
        blk = s.view(Tq, q.shape[1], nblk, BS).amax(-1)
        return torch.topk(blk, min(topk, nblk), dim=-1)

    return cuda_time(run, repeat)


def run_index(*, quick: bool = False, backends: Sequence[str] | None = None, repeat: int | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Run the index-branch suite; returns ``dict(rows=[...])``."""
    say = progress or (lambda s: None)
    repeat = repeat or (2 if quick else 10)
    avail = registry.list_backends()
    names = list(backends or [n for n in avail if avail[n].ok])
    t_ok, t_why = torch_available()
    rows = []
    for L, Tq in QUICK_INDEX_WORKLOADS if quick else INDEX_WORKLOADS:
        say(f"index L={L} Tq={Tq}: problem")
        p = _problem(L, Tq)
        row = dict(workload=f"index-L{L // 1024}k-Tq{Tq}", L=L, Tq=Tq, blocks=-(-L // p["block_size"]))
        for name in names:
            if name == "numpy" and not quick and L > 32768:
                continue  # minutes per call at 128k: not informative
            be = registry.get_backend(name)
            ik = be.upload_index_cache(p["index_k_cache"]) if hasattr(be, "upload_index_cache") else p["index_k_cache"]
            args = dict(p, index_k_cache=ik)
            say(f"{row['workload']}: {name}")

            def ours():
                sc = block_scores(args["index_q"], args["index_k_cache"], args["block_tables"], args["cu_seqlens_q"],
                                  args["used_kv_lens"], block_size=args["block_size"], causal=True, backend=be)
                return select_topk(sc, 16, force_local=True, cu_seqlens_q=args["cu_seqlens_q"],
                                   used_kv_lens=args["used_kv_lens"], block_size=args["block_size"], backend=be)

            row[f"{name}_s"] = _wall(ours, repeat if name != "numpy" else 1)
            if hasattr(ik, "release"):
                ik.release()
        if t_ok:
            say(f"{row['workload']}: torch")
            try:
                row["torch matmul+amax+topk_s"] = torch_topk(p, repeat=repeat)
                for name in names:
                    if row.get(f"{name}_s"):
                        row[f"{name}_speedup_vs_torch"] = row["torch matmul+amax+topk_s"] / row[f"{name}_s"]
            except Exception as exc:
                row["torch_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
    return dict(torch=t_why, rows=rows)
