"""kv_layout at the boundary (R34): every public function that takes caches validates it the
same way, reads the axes of the layout, and the numpy backend reads NHD without a copy."""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends.numpy_backend import hnd_view
from paged_sparse_attn.index_branch import (
    block_scores,
    block_scores_reference,
    sparse_attention,
)
from paged_sparse_attn.testing.problem import to_layout

rng = np.random.default_rng(11)
P, Hkv, S, D, G = 6, 2, 4, 8, 2
K = rng.standard_normal((P, Hkv, S, D)).astype(np.float32)
V = rng.standard_normal((P, Hkv, S, D)).astype(np.float32)
Q = rng.standard_normal((3, Hkv * G, D)).astype(np.float32)
IK = rng.standard_normal((P, 1, S, 4)).astype(np.float32)
IQ = rng.standard_normal((3, Hkv, 4)).astype(np.float32)
LAY = dict(block_tables=np.array([[5, 0, 3, -1], [1, 2, 4, 0]]), cu_seqlens_q=np.array([0, 2, 3]),
           used_kv_lens=np.array([11, 16]))
SEL = np.array([[[0, 1], [1, -1]], [[1, 0], [0, -1]], [[0, -1], [1, 0]]])


def test_R34_numpy_reads_nhd_through_a_view():
    kn = to_layout(K, "NHD")
    view = hnd_view(kn, "NHD")
    assert np.shares_memory(view, kn) and view.shape == K.shape and np.array_equal(view, K)


@pytest.mark.parametrize("fn", ["forward", "dense_reference"])
def test_R34_nhd_gives_the_bits_of_hnd_on_numpy(fn):
    f = getattr(psa, fn)
    for causal in (False, True):
        a = f(Q, K, V, selected=SEL, **LAY, block_size=8, causal=causal)
        b = f(Q, to_layout(K, "NHD"), to_layout(V, "NHD"), selected=SEL, **LAY, block_size=8, causal=causal,
              kv_layout="NHD")
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_R34_index_branch_in_nhd():
    args = (LAY["block_tables"], LAY["cu_seqlens_q"], LAY["used_kv_lens"])
    ikn = to_layout(IK, "NHD")
    assert np.array_equal(block_scores(IQ, IK, *args, block_size=8), block_scores(IQ, ikn, *args, block_size=8,
                                                                                   kv_layout="NHD"))
    assert np.array_equal(block_scores_reference(IQ, IK, *args, block_size=8),
                          block_scores_reference(IQ, ikn, *args, block_size=8, kv_layout="NHD"))
    a = sparse_attention(Q, K, V, IQ, IK, *args[:2], used_kv_lens=args[2], block_size=8, topk=2)
    b = sparse_attention(Q, to_layout(K, "NHD"), to_layout(V, "NHD"), IQ, ikn, *args[:2], used_kv_lens=args[2],
                         block_size=8, topk=2, kv_layout="NHD")
    assert np.array_equal(a, b)
    # index keys follow the caches' layout: an HND index cache with NHD caches is not paged like them
    with pytest.raises(psa.SpecError, match=r"index_k_cache must be paged like k_cache, \[P=6, S=4, Hk_idx, d_idx\].*\[R25\]"):
        sparse_attention(Q, to_layout(K, "NHD"), to_layout(V, "NHD"), IQ, IK, *args[:2], used_kv_lens=args[2],
                         block_size=8, topk=2, kv_layout="NHD")


BAD = ["nhd", "NDH", "", None, 0, ("NHD",)]


@pytest.mark.parametrize("bad", BAD)
def test_R34_any_other_kv_layout_is_a_spec_error_naming_it(bad):
    kn, vn = to_layout(K, "NHD"), to_layout(V, "NHD")
    index = psa.build_kvouter_index(SEL, LAY["block_tables"], LAY["cu_seqlens_q"], LAY["used_kv_lens"], block_size=8,
                                    page_size=S)
    calls = {
        "forward": lambda: psa.forward(Q, kn, vn, selected=SEL, **LAY, block_size=8, kv_layout=bad),
        "dense_reference": lambda: psa.dense_reference(Q, kn, vn, selected=SEL, **LAY, block_size=8, kv_layout=bad),
        "forward_partials": lambda: psa.forward_partials(Q, kn, vn, index, kv_layout=bad),
        "plan_attention": lambda: psa.plan_attention(LAY["block_tables"], LAY["cu_seqlens_q"], block_size=8,
                                                     page_size=S, num_q_heads=4, num_kv_heads=2, head_dim=D,
                                                     kv_dtype=np.float32, topk=2, kv_layout=bad),
        "block_scores": lambda: block_scores(IQ, IK, LAY["block_tables"], LAY["cu_seqlens_q"], block_size=8,
                                             kv_layout=bad),
        "sparse_attention": lambda: sparse_attention(Q, kn, vn, IQ, IK, LAY["block_tables"], LAY["cu_seqlens_q"],
                                                     block_size=8, topk=2, kv_layout=bad),
    }
    for name, call in calls.items():
        with pytest.raises(psa.SpecError) as e:
            call()
        msg = str(e.value)
        assert e.value.rule == "R34" and msg.startswith(f"{name}(): kv_layout must be"), msg
        assert '"HND"' in msg and '"NHD"' in msg and f"got {bad!r} [R34]" in msg


def test_R1_cache_axes_follow_the_layout():
    kn = to_layout(K, "NHD")  # [P, S=4, Hkv=2, D]
    # [P, 2, 4, D] is Hkv=2 in HND but Hkv=4 in NHD: Hq=6 fits the first reading only
    cache = np.zeros((P, 2, 4, D), np.float32)
    q6 = np.zeros((3, 6, D), np.float32)
    psa.forward(q6, cache, cache, selected=np.full((3, 2, 1), -1), **LAY, block_size=8)
    with pytest.raises(psa.SpecError, match=r"Hq=6 must be a positive multiple of Hkv=4.*\[R1\]"):
        psa.forward(q6, cache, cache, selected=np.full((3, 4, 1), -1), **LAY, block_size=8, kv_layout="NHD")
    with pytest.raises(psa.SpecError, match=r"page size \(axis 1, kv_layout='NHD'\) must be >= 1.*\[R1\]"):
        psa.forward(Q, np.zeros((P, 0, Hkv, D), np.float32), np.zeros((P, 0, Hkv, D), np.float32), selected=SEL,
                    **LAY, block_size=8, kv_layout="NHD")
    # the page size is axis 1 in NHD: block_size must be a multiple of it (R5)
    with pytest.raises(psa.SpecError, match=r"block_size must be a multiple of page_size=4.*\[R5\]"):
        psa.forward(Q, kn, to_layout(V, "NHD"), selected=SEL, **LAY, block_size=6, kv_layout="NHD")


def test_R34_a_plan_checks_its_caches_against_its_layout():
    plan = psa.plan_attention(LAY["block_tables"], LAY["cu_seqlens_q"], LAY["used_kv_lens"], block_size=8,
                              page_size=S, num_q_heads=4, num_kv_heads=Hkv, head_dim=D, kv_dtype=np.float32, topk=2,
                              kv_layout="NHD")
    assert np.array_equal(plan.run(Q, to_layout(K, "NHD"), to_layout(V, "NHD"), SEL),
                          psa.forward(Q, K, V, selected=SEL, **LAY, block_size=8))
    with pytest.raises(psa.SpecError, match=r"k_cache must be float32 \[P, 4, 2, 8\].*kv_layout='NHD'.*\[R32\]"):
        plan.run(Q, K, V, SEL)  # HND caches for an NHD plan
    hnd = psa.plan_attention(LAY["block_tables"], LAY["cu_seqlens_q"], LAY["used_kv_lens"], block_size=8,
                             page_size=S, num_q_heads=4, num_kv_heads=Hkv, head_dim=D, kv_dtype=np.float32, topk=2)
    assert plan.layout.structure_key() != hnd.layout.structure_key()  # the layout is part of the plan's key



@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_R32_forward_plan_cache_key_is_the_layouts_structure_key(kv_layout):
    # forward() looks its plan up by a key read off the problem: it must be the key of the
    # problem's layout, or forward() and device-array calls would plan the same layout twice
    from paged_sparse_attn._attention_plan import problem_key
    from paged_sparse_attn._layout import layout_of
    from paged_sparse_attn._validation import validate_forward

    for k, scale, causal in ((K, None, False), (K.astype(np.float16), 0.5, True)):
        p = validate_forward("forward", Q, to_layout(k, kv_layout), to_layout(k, kv_layout), LAY["block_tables"], SEL,
                             LAY["cu_seqlens_q"], used_kv_lens=LAY["used_kv_lens"], block_size=8,
                             softmax_scale=scale, causal=causal, kv_layout=kv_layout)
        assert problem_key(p) == layout_of(p).structure_key()

class _HndOnly(psa.Backend):
    name = "hnd-only"

    @classmethod
    def probe(cls):
        return psa.Availability(True, "ok")

    @property
    def capabilities(self):
        return psa.Capabilities(dtypes=("float32",))

    def forward_partials(self, problem, index):  # pragma: no cover - never reached for NHD
        raise AssertionError("called with an undeclared layout")


def test_R34_R18_an_undeclared_layout_raises_unsupported_before_the_backend():
    be = _HndOnly()
    assert psa.Capabilities().kv_layouts == ("HND",)
    with pytest.raises(psa.UnsupportedError, match=r"kv_layout 'NHD' is not supported \(supported: HND\).*\[R18\]"):
        psa.forward(Q, to_layout(K, "NHD"), to_layout(V, "NHD"), selected=SEL, **LAY, block_size=8, kv_layout="NHD",
                    backend=be)
