"""The numpy backend against the float64 dense reference on a broad seeded grid, its partials
against a direct per-edge recomputation (R14), and full selection against plain dense attention.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends import numpy_backend
from paged_sparse_attn.testing import assert_attention_close, tolerance
from paged_sparse_attn.testing.generate import random_problem

f32 = np.float32

# The numpy backend converts float16 data to float32 exactly after the gather and accumulates in
# float32, so it is held to the float32 tolerance even for float16 inputs (stricter than R20).
COMPUTE = f32

_G = (1, 2, 3, 8)
_D = (1, 3, 16, 64)
_S = (1, 2, 4, 16)
_PPB = (1, 2, 4)
_USED = ("random", "full", "zero", "default", "random", "random")
_SEQS = ((3, 2), (0, 4, 1), (1,), (2, 0, 0, 3), (5,), (1, 1, 1, 0))


def _grid(n=56):
    """n configurations; each axis cycles with a different period so that values mix."""
    out = []
    for i in range(n):
        msb = 1 + i % 4
        S = _S[(i // 2) % 4]
        ppb = _PPB[i % 3]
        if S * ppb > 32:  # keep the Python reference quick
            ppb = 1
        cfg = dict(
            G=_G[i % 4], D=_D[(i // 4) % 4], page_size=S, ppb=ppb, msb=msb,
            causal=bool((i // 3) % 2), dtype=np.float16 if i % 5 == 4 else f32,
            used=_USED[i % 6], seqlens_q=_SEQS[(i // 7) % 6], topk=(i * 7) % (msb + 2),
            Hkv=1 + (i % 7) % 2, hole_prob=(0.0, 0.25, 0.5)[i % 3], fill=(1.0, 0.6, 0.3)[(i // 5) % 3],
            share_prob=0.3 if i % 8 == 5 else 0.0, poison=i % 9 != 8,
        )
        out.append(pytest.param(i, cfg, id=f"{i}-G{cfg['G']}-D{cfg['D']}-S{S}-ppb{ppb}-msb{msb}"
                                f"-{'causal' if cfg['causal'] else 'full'}-{np.dtype(cfg['dtype']).name}"
                                f"-{cfg['used']}-topk{cfg['topk']}"))
    return out


@pytest.mark.parametrize("seed,cfg", _grid())
def test_numpy_backend_matches_dense_reference(seed, cfg):
    pb = random_problem(seed, **cfg)
    out, lse = psa.forward(*pb.args, **pb.options, backend="numpy", return_lse=True)
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert_attention_close(out, ref, dtype=COMPUTE, lse=lse, ref_lse=ref_lse, err_msg=f"seed {seed}")


def _direct_partials(pb, ix):
    """R14 for every edge, position by position, in float64."""
    E, G, D = ix.num_edges, pb.group_size, pb.q.shape[2]
    S, BS = ix.page_size, ix.block_size
    scale = pb.softmax_scale if pb.softmax_scale is not None else 1 / math.sqrt(D)
    o = np.zeros((E, G, D))
    m = np.full((E, G), -np.inf)
    l = np.zeros((E, G))
    for e in range(E):
        t, h, b, s, n = (int(a[e]) for a in (ix.edge_query, ix.edge_head, ix.edge_seq, ix.edge_block, ix.edge_len))
        pos = [p for p in range(s * BS, s * BS + n) if pb.block_tables[b, p // S] >= 0]
        if not pos:
            continue
        pages = pb.block_tables[b, [p // S for p in pos]]
        k = pb.k_cache[pages, h, [p % S for p in pos]].astype(np.float64)
        v = pb.v_cache[pages, h, [p % S for p in pos]].astype(np.float64)
        for g in range(G):
            sc = scale * (k @ pb.q[t, h * G + g].astype(np.float64))
            m[e, g] = sc.max()
            w = np.exp(sc - m[e, g])
            l[e, g] = w.sum()
            o[e, g] = w @ v
    return o, m, l


@pytest.mark.parametrize("seed", range(6))
def test_R14_partials_match_a_direct_per_edge_recomputation(seed):
    pb = random_problem(seed, seqlens_q=(3, 0, 2), G=(1, 2, 3)[seed % 3], causal=bool(seed % 2), msb=3,
                      page_size=(1, 2, 4)[seed % 3], ppb=2, hole_prob=0.3, used="random")
    ix = pb.build_index()
    pt = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, ix, backend="numpy")
    o, m, l = _direct_partials(pb, ix)
    assert pt.o.shape == o.shape and pt.m.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(pt.m), np.isneginf(m))
    tol = tolerance(COMPUTE).out
    fin = np.isfinite(m)
    assert (np.abs(pt.m[fin] - m[fin]) <= tol * np.maximum(1, np.abs(m[fin]))).all()
    assert (np.abs(pt.l - l) <= tol * np.maximum(1, l)).all()
    assert (pt.l[~fin] == 0).all() and (pt.o[~fin] == 0).all()
    assert_attention_close(pt.o, o, dtype=COMPUTE, err_msg="partials o")


def _contiguous_problem(seed, L, T, D=4, Hkv=2, G=2, S=2, ppb=2, causal=True):
    """One sequence whose pages are 0..n-1 in order; returns the problem and plain K, V [L, Hkv, D]."""
    rng = np.random.default_rng(seed)
    BS = S * ppb
    msb = -(-L // BS)
    P = msb * ppb
    kc = rng.standard_normal((P, Hkv, S, D)).astype(f32)
    vc = rng.standard_normal((P, Hkv, S, D)).astype(f32)
    q = rng.standard_normal((T, Hkv * G, D)).astype(f32)
    sel = np.tile(rng.permutation(msb), (T, Hkv, 1))  # every block, in a scrambled slot order
    pb = random_problem(0, poison=False)  # only for the container type
    pb = pb.replace(q=q, k_cache=kc, v_cache=vc, block_tables=np.arange(P)[None, :], selected=sel,
                  cu_seqlens_q=np.array([0, T]), used_kv_lens=np.array([L]), block_size=BS, causal=causal,
                  softmax_scale=None)
    K = kc.transpose(0, 2, 1, 3).reshape(P * S, Hkv, D)[:L]
    V = vc.transpose(0, 2, 1, 3).reshape(P * S, Hkv, D)[:L]
    return pb, K, V


def _plain_attention(q, K, V, causal):
    """softmax(q K^T / sqrt(D) + mask) V with the bottom-right causal mask, float64."""
    T, Hq, D = q.shape
    L, Hkv, _ = K.shape
    G = Hq // Hkv
    out = np.zeros((T, Hq, D))
    for hq in range(Hq):
        s = q[:, hq].astype(np.float64) @ K[:, hq // G].astype(np.float64).T / math.sqrt(D)  # [T, L]
        if causal:
            s = np.where(np.arange(L)[None, :] <= (L - T + np.arange(T))[:, None], s, -np.inf)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, hq] = (w / w.sum(axis=1, keepdims=True)) @ V[:, hq // G]
    return out


@pytest.mark.parametrize("L,T,causal", [(10, 3, True), (16, 16, True), (7, 1, True), (9, 4, False), (12, 5, True)])
def test_full_selection_equals_plain_dense_attention(L, T, causal):
    pb, K, V = _contiguous_problem(L * 31 + T, L, T, causal=causal)
    plain = _plain_attention(pb.q, K, V, causal)
    out = psa.forward(*pb.args, **pb.options, backend="numpy")
    ref, _ = psa.dense_reference(*pb.args, **pb.options)
    assert_attention_close(out, plain, dtype=f32, err_msg="numpy vs plain")
    assert_attention_close(ref, plain, dtype=f32, err_msg="dense_reference vs plain")


def test_small_chunks_give_the_same_result(monkeypatch):
    # the backend cuts slot groups into chunks bounded by _CHUNK_ELEMS; force many tiny chunks
    pb = random_problem(21, seqlens_q=(6, 5, 3), msb=4, topk=4, fill=0.8, G=3, D=5, causal=True)
    whole = psa.forward(*pb.args, **pb.options, backend="numpy", return_lse=True)
    monkeypatch.setattr(numpy_backend, "_CHUNK_ELEMS", 1)
    tiny = psa.forward(*pb.args, **pb.options, backend="numpy", return_lse=True)
    assert_attention_close(tiny[0], whole[0].astype(np.float64), dtype=f32, lse=tiny[1],
                              ref_lse=whole[1].astype(np.float64))
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    assert_attention_close(tiny[0], ref, dtype=f32, lse=tiny[1], ref_lse=ref_lse)


def test_many_queries_share_one_block():
    # a slot group with many edges (the KV-outer case the design is for): 24 queries, one block
    pb = random_problem(5, seqlens_q=(24,), msb=8, topk=1, fill=1.0, hole_prob=0.0, G=4, D=8, causal=True,
                      used="full")
    pb.selected[:] = 1
    out, lse = psa.forward(*pb.args, **pb.options, backend="numpy", return_lse=True)
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    assert_attention_close(out, ref, dtype=f32, lse=lse, ref_lse=ref_lse)
    ix = pb.build_index()
    assert ix.num_slots == pb.selected.shape[1]  # one slot group per KV head
    assert ix.num_edges == 24 * pb.selected.shape[1]  # block 1 starts at 4 < 32 - 24 + 1: nobody drops it
