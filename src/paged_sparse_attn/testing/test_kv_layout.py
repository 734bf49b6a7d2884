"""R34: the page layout of the caches, on every selected backend.

A backend that declares a layout in ``capabilities.kv_layouts`` must give, for the same logical
cache, the same bits in that layout as in the other declared one (the layout is addressing only);
a layout it does not declare must be refused with ``UnsupportedError`` before any backend work,
never transposed behind the caller's back. The rest of the suite draws both layouts too
(``strategies.problems(kv_layout=...)``), so every rule is checked in each declared layout.
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the conformance suite needs hypothesis: pip install 'paged_sparse_attn[test]'") from exc

import paged_sparse_attn as psa
from paged_sparse_attn.index_branch import block_scores, sparse_attention
from paged_sparse_attn.testing import strategies as pst
from paged_sparse_attn.testing.problem import to_layout

SEEDS = st.integers(0, 2**32 - 1)


def _layouts(backend) -> tuple[str, ...]:
    return tuple(getattr(backend.capabilities, "kv_layouts", ("HND",)))


def _bits(a, b) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b))


def _index_branch(backend) -> bool:
    return bool(getattr(backend.capabilities, "index_branch", False))


@given(data=st.data())
def test_R34_both_layouts_give_the_same_bits(backend, data):
    """The same logical cache in NHD and HND: ``forward`` (out and lse) and ``forward_partials``
    give the same bits; so do ``block_scores`` and ``sparse_attention`` on index keys paged the
    same way, and plans and device-resident caches where the backend has them."""
    both = [x for x in pst.KV_LAYOUTS if x in _layouts(backend)]
    if len(both) < 2:
        pytest.skip(f"backend {backend.name!r} declares kv_layouts={_layouts(backend)}: nothing to compare "
                    "(test_R34_an_undeclared_layout_is_refused checks the refusal)")
    p = data.draw(pst.problems(caps=backend.capabilities, kv_layout="HND"), label="problem")
    runs = {x: p.replace(kv_layout=x).forward(backend) for x in both}
    assert _bits(runs["HND"], runs["NHD"]), "R34: forward() differs between kv_layout='HND' and 'NHD'"

    index = p.build_index()
    parts = {x: psa.forward_partials(p.q, to_layout(p.k_cache, x), to_layout(p.v_cache, x), index,
                                     softmax_scale=p.softmax_scale, kv_layout=x, backend=backend) for x in both}
    assert _bits((parts["HND"].o, parts["HND"].m, parts["HND"].l), (parts["NHD"].o, parts["NHD"].m, parts["NHD"].l)), \
        "R34: forward_partials() differs between the layouts"

    upload = getattr(backend, "upload_kv_cache", None)
    if backend.capabilities.device_arrays and upload is not None:
        dev = {}
        for x in both:
            k, v = upload(to_layout(p.k_cache, x), to_layout(p.v_cache, x), kv_layout=x)
            assert k.kv_layout == x and tuple(k.shape) == to_layout(p.k_cache, x).shape
            dev[x] = psa.forward(**{**p.replace(kv_layout=x).kwargs(), "k_cache": k, "v_cache": v},
                                 backend=backend, return_lse=True)
        assert _bits(dev["HND"], dev["NHD"]), "R34: forward() on device-resident caches differs between the layouts"

    plans = {}
    for x in both:
        plan = psa.plan_attention(p.block_tables, p.cu_seqlens_q, p.used_kv_lens, block_size=p.block_size,
                                  page_size=p.page_size, num_q_heads=p.num_q_heads, num_kv_heads=p.num_kv_heads,
                                  head_dim=p.head_dim, kv_dtype=p.k_cache.dtype, topk=p.topk, causal=p.causal,
                                  softmax_scale=p.softmax_scale, kv_layout=x, backend=backend)
        plans[x] = plan.run(p.q, to_layout(p.k_cache, x), to_layout(p.v_cache, x), p.selected, return_lse=True)
        plan.close()
    assert _bits(plans["HND"], plans["NHD"]), "R34: AttentionPlan.run() differs between the layouts"

    if not _index_branch(backend) or p.num_queries == 0:
        return
    rng = np.random.default_rng(data.draw(SEEDS, label="index seed"))
    hk = data.draw(st.sampled_from([1, p.num_kv_heads]), label="Hk_idx")
    d = data.draw(st.sampled_from([1, 4, 5]), label="d_idx")
    iq = rng.standard_normal((p.num_queries, p.num_kv_heads, d)).astype(p.k_cache.dtype)
    ik = rng.standard_normal((p.num_pages, hk, p.page_size, d)).astype(p.k_cache.dtype)
    args = (p.block_tables, p.cu_seqlens_q, p.used_kv_lens)
    sc = {x: block_scores(iq, to_layout(ik, x), *args, block_size=p.block_size, causal=p.causal, kv_layout=x,
                          backend=backend) for x in both}
    assert _bits((sc["HND"],), (sc["NHD"],)), "R34: block_scores() differs between the layouts"
    topk = max(1, p.topk)
    sa = {x: sparse_attention(p.q, to_layout(p.k_cache, x), to_layout(p.v_cache, x), iq, to_layout(ik, x), *args[:2],
                              used_kv_lens=p.used_kv_lens, block_size=p.block_size, topk=topk, causal=p.causal,
                              softmax_scale=p.softmax_scale, kv_layout=x, backend=backend, return_lse=True)
          for x in both}
    assert _bits(sa["HND"], sa["NHD"]), "R34: sparse_attention() differs between the layouts"


@given(data=st.data())
def test_R34_an_undeclared_layout_is_refused(backend, data):
    """Every layout runs if the backend declares it and raises UnsupportedError (R18) before any
    backend work if it does not; an undeclared layout is never run through a transposed copy."""
    p = data.draw(pst.problems(caps=backend.capabilities, kv_layout="HND", max_queries=4), label="problem")
    for x in pst.KV_LAYOUTS:
        q = p.replace(kv_layout=x)
        if x in _layouts(backend):
            out, lse = q.forward(backend)
            assert out.shape == p.q.shape and lse.shape == p.q.shape[:2]
            continue
        calls = []
        saved = {n: getattr(backend, n) for n in ("forward", "forward_partials")}
        try:
            for n in saved:  # the refusal comes first: the backend is never asked to compute
                setattr(backend, n, lambda *a, _n=n, _calls=calls, **k: _calls.append(_n))
            with pytest.raises(psa.UnsupportedError, match=r"kv_layout.*\[R18\]"):
                q.forward(backend)
            with pytest.raises(psa.UnsupportedError, match=r"kv_layout.*\[R18\]"):
                psa.plan_attention(p.block_tables, p.cu_seqlens_q, p.used_kv_lens, block_size=p.block_size,
                                   page_size=p.page_size, num_q_heads=p.num_q_heads, num_kv_heads=p.num_kv_heads,
                                   head_dim=p.head_dim, kv_dtype=p.k_cache.dtype, topk=p.topk, kv_layout=x,
                                   backend=backend)
        finally:
            for n in saved:
                delattr(backend, n)
        assert not calls, f"backend work ran for an undeclared kv_layout={x!r}: {calls}"
