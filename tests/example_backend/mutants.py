"""Deliberately broken backends, one bug each: the property suite must fail every one of them.

``Correct`` is the same per-edge algorithm without a bug (it passes the whole kit, index branch
and batch invariance included); each other class changes one step the way real kernels get it
wrong. ``MUTANTS`` break the attention rules; ``CONTRACT_MUTANTS`` break the backend contract
(R15 through the backend's own combine, R19, R22, R24, R26, R27, and the R6 check of what a backend
returns), each with the tests that must catch it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import paged_sparse_attn as psa
from paged_sparse_attn.backends.numpy_index import (
    block_scores_numpy,
    select_topk_numpy,
)

from .loop_backend import LoopBackend

__all__ = ["Correct", "MUTANTS", "CONTRACT_MUTANTS"]


class Correct(LoopBackend):
    """Per-edge partials with overridable steps."""

    name = "mutant-base"

    @property
    def capabilities(self) -> psa.Capabilities:
        # per-edge loops: a row's bits depend on its own edges only (R27)
        return psa.Capabilities(dtypes=("float32", "float16"), max_head_dim=64, deterministic=True,
                                batch_invariant=True, index_branch=True, device="cpu (loops)")

    def block_scores(self, problem):
        return block_scores_numpy(problem)

    def select_topk(self, problem):
        return select_topk_numpy(problem)

    def positions(self, index, e):
        """Attended logical positions of the edge and their physical pages."""
        BS, S = index.block_size, index.page_size
        pos = index.edge_block[e] * BS + np.arange(int(index.edge_len[e]))
        pages = index.block_tables[index.edge_seq[e], pos // S]
        return pos[pages >= 0], pages[pages >= 0]

    def query_heads(self, problem, h):
        G = problem.group_size
        return np.arange(h * G, (h + 1) * G)  # R1: query head hq reads KV head hq // G

    def partial(self, q, kk, vv, scale):
        s = np.float32(scale) * (q @ kk.T)  # [G, n] float32 scores: overflow gives +-inf (R26)
        G = s.shape[0]
        m = np.full(G, -np.inf, np.float32)
        l = np.zeros(G, np.float32)
        o = np.zeros((G, vv.shape[1]), np.float32)
        for g in range(G):
            keep = s[g] != -np.inf  # a -inf score removes its position, value included (R26)
            if keep.any():  # (none left: the head's partial stays empty)
                m[g] = s[g, keep].max()  # a NaN score stays NaN
                p = np.exp(s[g, keep] - m[g])
                l[g], o[g] = p.sum(), p @ vv[keep]
        return m, l, o

    def forward_partials(self, problem, index):
        q = np.asarray(problem.q, np.float32)
        k, v = problem.k_cache, problem.v_cache
        G, D, S, E = problem.group_size, problem.head_dim, index.page_size, index.num_edges
        o = np.zeros((E, G, D), np.float32)
        m = np.full((E, G), -np.inf, np.float32)
        l = np.zeros((E, G), np.float32)
        with np.errstate(all="ignore"):
            for e in range(E):
                t, h = index.edge_query[e], index.edge_head[e]
                pos, pages = self.positions(index, e)
                if pos.size:
                    kk = k[pages, h, pos % S].astype(np.float32)
                    vv = v[pages, h, pos % S].astype(np.float32)
                    m[e], l[e], o[e] = self.partial(q[t, self.query_heads(problem, h)], kk, vv,
                                                    problem.softmax_scale)
        return psa.Partials(o, m, l)


class FiniteSentinel(Correct):
    """An empty edge reports m = -1e4 (a finite "minus infinity") and l = 1."""

    def forward_partials(self, problem, index):
        p = super().forward_partials(problem, index)
        empty = np.isneginf(p.m)
        return psa.Partials(p.o, np.where(empty, np.float32(-1e4), p.m), np.where(empty, np.float32(1), p.l))


class ReadsUnmappedPages(Correct):
    """Unmapped (-1) pages are read as physical page 0."""

    def positions(self, index, e):
        BS, S = index.block_size, index.page_size
        pos = index.edge_block[e] * BS + np.arange(int(index.edge_len[e]))
        return pos, np.maximum(index.block_tables[index.edge_seq[e], pos // S], 0)


class IgnoresKVLength(Correct):
    """Attends the whole block, past L_b and past the causal limit."""

    def positions(self, index, e):
        BS, S = index.block_size, index.page_size
        pos = index.edge_block[e] * BS + np.arange(BS)
        pages = index.block_tables[index.edge_seq[e], pos // S]
        return pos[pages >= 0], pages[pages >= 0]


class WrongHeadGrouping(Correct):
    """Query head hq reads KV head hq % Hkv (interleaved groups) instead of hq // G."""

    def query_heads(self, problem, h):
        return np.arange(problem.group_size) * problem.num_kv_heads + h


class NoRunningMax(Correct):
    """exp(score) without subtracting the max: overflows for large logits."""

    def partial(self, q, kk, vv, scale):
        p = np.exp(np.float32(scale) * (q @ kk.T))
        return np.zeros(p.shape[0], np.float32), p.sum(axis=1), p @ vv


class Base2Max(Correct):
    """Reports m in base 2 (log2 domain) while the spec's partials are natural-log."""

    def partial(self, q, kk, vv, scale):
        m, l, o = super().partial(q, kk, vv, scale)
        return m / np.float32(np.log(2.0)), l, o


class Float16Scores(Correct):
    """Computes the scores in float16 (R12 asks for float32 at least)."""

    def partial(self, q, kk, vv, scale):
        s = (np.float16(scale) * (q.astype(np.float16) @ kk.astype(np.float16).T)).astype(np.float32)
        m = s.max(axis=1)
        p = np.exp(s - m[:, None])
        return m, p.sum(axis=1), p @ vv


class BatchDependent(Correct):
    """Takes another exp for a batch than for a single sequence: same tolerance, other bits (R27)."""

    def forward_partials(self, problem, index):
        self.batched = problem.num_seqs > 1
        return super().forward_partials(problem, index)

    def partial(self, q, kk, vv, scale):
        if not self.batched:
            return super().partial(q, kk, vv, scale)
        s = np.float32(scale) * (q @ kk.T)
        m = s.max(axis=1)
        p = np.exp2((s - m[:, None]) * np.float32(np.log2(np.e)))
        return m, p.astype(np.float64).sum(axis=1).astype(np.float32), (p.astype(np.float64) @ vv).astype(np.float32)


class Noisy(Correct):
    """Declares itself non-deterministic and adds run-to-run noise far beyond R20 (breaks R19)."""

    @property
    def capabilities(self):
        return dataclasses.replace(super().capabilities, deterministic=False, batch_invariant=False)

    def partial(self, q, kk, vv, scale):
        m, l, o = super().partial(q, kk, vv, scale)
        return m, l, o * np.float32(1 + 1e-2 * np.random.default_rng().standard_normal())


class OwnCombineBase2(Correct):
    """Its forward is right, but its own combine_partials returns a base-2 lse (breaks R15)."""

    def forward(self, problem, index):
        from paged_sparse_attn._combine import combine_partials_numpy

        return combine_partials_numpy(self.forward_partials(problem, index), index)

    def combine_partials(self, partials, index):
        from paged_sparse_attn._combine import combine_partials_numpy

        out, lse = combine_partials_numpy(partials, index)
        return out, (lse / np.float32(np.log(2.0))).astype(np.float32)


class ScoresIgnoreCausal(Correct):
    """Block scores see the causal future (breaks R22)."""

    def block_scores(self, problem):
        ends = problem.used_kv_lens[problem.query_seq].astype(np.int32)
        return block_scores_numpy(dataclasses.replace(problem, causal=False, query_end=ends))


class TiesToHigherId(Correct):
    """Equal scores ranked by descending block id (breaks R24); the local block stays first."""

    def select_topk(self, problem):
        Tq, Hkv, msb = problem.scores.shape
        out = np.full((Tq, Hkv, problem.topk), -1, np.int32)
        for t in range(Tq):
            local = int(problem.local_block[t])
            for h in range(Hkv):
                row = [float(x) for x in problem.scores[t, h]]
                ranked = sorted((s for s in range(msb) if s != local and row[s] > -np.inf),
                                key=lambda s: (-row[s], -s))
                chosen = (([local] if local >= 0 else []) + ranked)[:problem.topk]
                out[t, h, :len(chosen)] = chosen
        return out


class RepeatsLocalBlock(Correct):
    """Fills a free slot with the local block again: a duplicate id (the API's R6 check)."""

    def select_topk(self, problem):
        sel = select_topk_numpy(problem).copy()
        if sel.shape[2] > 1:
            free = (sel[..., 1] == -1) & (sel[..., 0] >= 0)
            sel[..., 1] = np.where(free, sel[..., 0], sel[..., 1])
        return sel


MUTANTS = ("FiniteSentinel", "ReadsUnmappedPages", "IgnoresKVLength", "WrongHeadGrouping", "NoRunningMax",
           "Base2Max", "Float16Scores")


class MultipliesRemovedValues(Correct):
    """Gives a -inf score the weight exp(-inf - m) = 0 and multiplies its value by it: a NaN value
    there reaches the output, and a row whose scores are all -inf gives NaN, not an empty row."""

    def partial(self, q, kk, vv, scale):
        s = np.float32(scale) * (q @ kk.T)
        m = s.max(axis=1)
        p = np.exp(s - m[:, None])
        return m, p.sum(axis=1), p @ vv


CONTRACT_MUTANTS = {
    "BatchDependent": "R27",
    "MultipliesRemovedValues": "R26",
    "Noisy": "R19",
    "OwnCombineBase2": "R15_the_backends_own_combine",
    "ScoresIgnoreCausal": "R22",
    "TiesToHigherId": "R24",
    "RepeatsLocalBlock": "R24 or R25",
}
"""Mutant -> the ``-k`` expression of the kit tests that must fail it."""
