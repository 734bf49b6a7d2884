"""What ``batch_invariant=True`` costs on the decode workload: kernel time (partials + combine,
steady state) with the default kernels and with the batch-invariant geometry.

Usage: ``python scripts/batch_invariance_cost.py``.
"""

from __future__ import annotations

import paged_sparse_attn as psa
from paged_sparse_attn._validation import validate_forward
from paged_sparse_attn.backends.wgpu import WgpuBackend
from paged_sparse_attn.bench.workloads import Workload, make_problem


def main() -> None:
    w = Workload("decode-f16", B=32, L=32768, Tq_per_seq=1)
    p = make_problem(w, seed=1, fill="selected")
    ix = psa.build_kvouter_index(p["selected"], p["block_tables"], p["cu_seqlens_q"], p["used_kv_lens"],
                                 block_size=w.block_size, page_size=w.page_size, causal=w.causal)
    for inv in (False, True):
        be = WgpuBackend(timestamps=True, batch_invariant=inv)
        k, v = be.upload_kv_cache(p["k_cache"], p["v_cache"])
        prob = validate_forward("x", p["q"], k, v, p["block_tables"], p["selected"], p["cu_seqlens_q"],
                                used_kv_lens=p["used_kv_lens"], block_size=w.block_size, softmax_scale=None,
                                causal=w.causal)
        r = be.profile_forward(prob, ix, repeat=20, replay="auto", warmup_s=0.5)
        print(f"batch_invariant={inv}: kernel {r['kernel']}, partials+combine {r['call_s'] * 1e6:.1f} us")
        be.close()


if __name__ == "__main__":
    main()
