"""A third-party backend in a few lines: the R14 partials of every edge, one edge at a time.

``LoopBackend`` is what docs/testing.md walks through: a subclass of ``psa.Backend`` that
computes each edge's online-softmax partial with plain numpy and leaves the rest (validation,
the KV-outer index, the combine) to the package. It passes the conformance kit::

    pytest --pyargs paged_sparse_attn.testing --backend example_backend.loop_backend:LoopBackend

The variants below are deliberately wrong, so that the kit can be shown to catch them.
"""

from __future__ import annotations

import numpy as np

import paged_sparse_attn as psa

__all__ = ["LoopBackend", "CausalBlindLoopBackend", "UnavailableBackend", "make_unavailable"]


# --8<-- [start:loop]
class LoopBackend(psa.Backend):
    """R14 partials, one edge at a time, in float32."""

    name = "loop"

    @classmethod
    def probe(cls) -> psa.Availability:
        return psa.Availability(True, "ok: numpy loops on the CPU")

    @property
    def capabilities(self) -> psa.Capabilities:
        return psa.Capabilities(dtypes=("float32", "float16"), max_head_dim=64, device="cpu (loops)")

    def attended(self, problem: psa.AttentionInputs, index: psa.KVOuterIndex, e: int) -> int:
        """How many leading positions of the edge's block it may attend (R9, R13)."""
        return int(index.edge_len[e])

    def forward_partials(self, problem: psa.AttentionInputs, index: psa.KVOuterIndex) -> psa.Partials:
        q = np.asarray(problem.q, dtype=np.float32)
        k, v = problem.k_cache, problem.v_cache
        G, D = problem.group_size, problem.head_dim
        BS, S = index.block_size, index.page_size
        E = index.num_edges
        o = np.zeros((E, G, D), np.float32)
        m = np.full((E, G), -np.inf, np.float32)  # an edge that attends nothing keeps (0, -inf, 0)
        l = np.zeros((E, G), np.float32)
        for e in range(E):
            t, h, b = index.edge_query[e], index.edge_head[e], index.edge_seq[e]
            pos = index.edge_block[e] * BS + np.arange(self.attended(problem, index, e))
            pages = index.block_tables[b, pos // S]
            pos, pages = pos[pages >= 0], pages[pages >= 0]  # unmapped pages are never read (R10)
            if pos.size == 0:
                continue
            kk = k[pages, h, pos % S].astype(np.float32)  # [n, D]: only attended cells are read
            vv = v[pages, h, pos % S].astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore"):  # NaN/Inf the edge attends stays (R26)
                s = np.float32(problem.softmax_scale) * (q[t, h * G:(h + 1) * G] @ kk.T)  # [G, n]
                for g in range(G):
                    keep = s[g] != -np.inf  # a -inf score removes its position, value included (R26)
                    if keep.any():  # (none left: the head's partial stays empty)
                        m[e, g] = s[g, keep].max()  # a NaN score stays NaN
                        p = np.exp(s[g, keep] - m[e, g])
                        l[e, g], o[e, g] = p.sum(), p @ vv[keep]
        return psa.Partials(o, m, l)
# --8<-- [end:loop]


class CausalBlindLoopBackend(LoopBackend):
    """Deliberately wrong: ignores the causal mask inside a block (attends up to L_b)."""

    name = "loop-causal-blind"

    def attended(self, problem, index, e):
        b, s = index.edge_seq[e], index.edge_block[e]
        return int(min(index.block_size, index.used_kv_lens[b] - s * index.block_size))


class UnavailableBackend(LoopBackend):
    """A backend whose probe says it cannot run here (for the --require-backend tests)."""

    name = "loop-unavailable"

    @classmethod
    def probe(cls) -> psa.Availability:
        return psa.Availability(False, "needs a device this machine does not have")


def make_unavailable() -> psa.Backend:
    """A plain factory function (no probe of its own) building a backend whose probe says no."""
    return UnavailableBackend()
