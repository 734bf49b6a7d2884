"""Deliberately broken backends, one bug each: the property suite must fail every one of them.

``Correct`` is the same per-edge algorithm without a bug (it passes the whole kit); each other
class changes one step the way real kernels get it wrong.
"""

from __future__ import annotations

import numpy as np

import paged_sparse_attn as psa

from .loop_backend import LoopBackend

__all__ = ["Correct", "MUTANTS"]


class Correct(LoopBackend):
    """Per-edge partials with overridable steps."""

    name = "mutant-base"

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
        s = np.float32(scale) * (q @ kk.T)
        m = s.max(axis=1)
        p = np.exp(s - m[:, None])
        return m, p.sum(axis=1), p @ vv

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


MUTANTS = ("FiniteSentinel", "ReadsUnmappedPages", "IgnoresKVLength", "WrongHeadGrouping", "NoRunningMax",
           "Base2Max", "Float16Scores")
