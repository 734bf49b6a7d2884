"""Block-score kernel variants on the decode layer (GPU timestamps): which part costs the time.

Usage: ``python scripts/experiment_scores.py``. Prints the median GPU time of the block-score
pass of ``AttentionPlan.run_sparse`` for the decode layer workload, for several workgroup-memory
stage sizes and for variants of the kernel with its loads or its arithmetic removed (timing
only: the variants compute wrong scores).
"""

from __future__ import annotations

import numpy as np

import paged_sparse_attn as psa
from paged_sparse_attn.backends.wgpu import _index_branch as ib
from paged_sparse_attn.bench.layer import LAYER_WORKLOADS
from paged_sparse_attn.bench.workloads import make_problem


def main() -> None:
    lw = LAYER_WORKLOADS[0]
    w = lw.w
    p = make_problem(w, seed=1, fill="selected")
    rng = np.random.default_rng(3)
    ik = rng.standard_normal((p["k_cache"].shape[0], 1, w.page_size, lw.index_dim), dtype=np.float32).astype(w.dtype)
    iq = rng.standard_normal((p["q"].shape[0], w.Hkv, lw.index_dim), dtype=np.float32)
    orig_src = ib.shader_source
    variants = {
        "as is": lambda s: s,
        "no arithmetic": lambda s: s.replace("if (live) {\n                for (var dd", "if (false) {\n                for (var dd"),
        "no key loads": lambda s: s.replace("v = vec4<f32>(ik[((slab - params.chunk_first) * S + lpos % S) * DV + j0 + j]);",
                                            "v = vec4<f32>(f32(slab));"),
    }
    for stage in ((8, 4, 2, 1), (2, 1)):
        for name, edit in variants.items():
            if stage != (8, 4, 2, 1) and name != "as is":
                continue
            ib.SCORES_STAGE = {64: stage}
            ib.SCORES_STAGE_SMALL = stage
            ib.shader_source = lambda n, f16=False, _e=edit: _e(orig_src(n, f16=f16)) if n == ib.SCORES else orig_src(n, f16=f16)
            be = psa.backends.wgpu.WgpuBackend(timestamps=True)
            k, v = be.upload_kv_cache(p["k_cache"], p["v_cache"])
            ikd = be.upload_index_cache(ik)
            plan = psa.plan_attention(p["block_tables"], p["cu_seqlens_q"], p["used_kv_lens"], block_size=w.block_size,
                                      page_size=w.page_size, num_q_heads=w.Hq, num_kv_heads=w.Hkv, head_dim=w.D,
                                      kv_dtype=w.dtype, topk=w.topk, causal=w.causal, index_dim=lw.index_dim,
                                      num_index_heads=1, index_dtype=w.dtype, backend=be)
            ts = []
            for _ in range(8):
                plan.run_sparse(p["q"], k, v, iq, ikd)
                ts.append(be.last_timings.get("gpu_scores_s", float("nan")))
            print(f"stage {stage[0]} {name:14s}: block scores {np.median(ts[2:]) * 1e6:8.1f} us")
            be.close()
    ib.shader_source = orig_src


if __name__ == "__main__":
    main()
