"""The wgpu backend's NHD caches (R34): strided kernels, whole-page chunks, the same bits as HND.

The kit's R34 properties run on small single-binding caches; these tests split caches and index
keys into several storage bindings (chunks), take both partials kernels, and check the resident
caches' own operations (readback, page updates) in NHD.
"""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.index_branch import block_scores, sparse_attention
from paged_sparse_attn.testing.problem import to_layout


def _problem(seed: int, P=12, Hkv=3, S=2, D=8, G=2, Tq=5, dtype=np.float32, one_query_per_seq=False):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((P, Hkv, S, D)).astype(dtype)
    v = rng.standard_normal((P, Hkv, S, D)).astype(dtype)
    bt = np.stack([rng.permutation(P)[:6], rng.permutation(P)[:6]]).astype(np.int32)
    bt[1, 2] = -1  # a hole
    Tq = 2 if one_query_per_seq else Tq
    q = rng.standard_normal((Tq, Hkv * G, D)).astype(np.float32)
    sel = np.stack([np.stack([rng.permutation(3)[:2] for _ in range(Hkv)]) for _ in range(Tq)]).astype(np.int32)
    kw = dict(block_tables=bt, selected=sel, cu_seqlens_q=np.array([0, 1, Tq]), used_kv_lens=np.array([11, 9]),
              block_size=2 * S)
    return q, k, v, kw


@pytest.mark.parametrize("opts", [dict(max_binding_size=512, max_workgroups_per_dim=2),
                                  dict(max_binding_size=1024, partials_kernel="decode"),
                                  dict(max_binding_size=2048, partials_kernel="generic"),
                                  dict()], ids=["split", "decode-split", "generic-split", "one-binding"])
@pytest.mark.parametrize("causal", [False, True])
def test_R34_nhd_and_hnd_give_the_same_bits_across_chunks(WgpuBackend, opts, causal):
    be = WgpuBackend(required_limits="default", **opts)
    decode = opts.get("partials_kernel") == "decode"
    q, k, v, kw = _problem(3, one_query_per_seq=decode)
    kn, vn = to_layout(k, "NHD"), to_layout(v, "NHD")
    host = psa.forward(q, k, v, **kw, causal=causal, backend=be, return_lse=True)
    host_nhd = psa.forward(q, kn, vn, **kw, causal=causal, kv_layout="NHD", backend=be, return_lse=True)
    assert all(np.array_equal(a, b) for a, b in zip(host, host_nhd))
    ref, _ = psa.dense_reference(q, k, v, **kw, causal=causal)
    assert np.allclose(host[0], ref, atol=1e-5)
    index = psa.build_kvouter_index(kw["selected"], kw["block_tables"], kw["cu_seqlens_q"], kw["used_kv_lens"],
                                    block_size=kw["block_size"], page_size=k.shape[2], causal=causal)
    pa = psa.forward_partials(q, k, v, index, backend=be)
    pb = psa.forward_partials(q, kn, vn, index, kv_layout="NHD", backend=be)
    assert all(np.array_equal(getattr(pa, f), getattr(pb, f)) for f in "oml")
    # whole caches on the device: cut at the same pages in both layouts
    kd, vd = be.upload_kv_cache(k, v)
    knd, vnd = be.upload_kv_cache(kn, vn, kv_layout="NHD")
    if opts:
        assert knd.layout.n_chunks > 1  # the split path is really taken
    assert np.array_equal(knd.layout.chunk_starts, kd.layout.chunk_starts)
    assert (knd.layout.chunk_starts % k.shape[1] == 0).all()  # whole pages
    res = psa.forward(q, kd, vd, **kw, causal=causal, return_lse=True)
    res_nhd = psa.forward(q, knd, vnd, **kw, causal=causal, kv_layout="NHD", return_lse=True)
    assert all(np.array_equal(a, b) for a, b in zip(res, res_nhd))
    # one side resident, the other on the host (uploaded in the resident side's layout)
    mixed = psa.forward(q, knd, vn, **kw, causal=causal, kv_layout="NHD", return_lse=True)
    assert all(np.array_equal(a, b) for a, b in zip(res, mixed))


def test_R34_resident_nhd_cache_reads_back_and_updates_pages_in_its_layout(WgpuBackend):
    be = WgpuBackend(required_limits="default", max_binding_size=512)
    q, k, v, kw = _problem(5)
    kn, vn = to_layout(k, "NHD"), to_layout(v, "NHD")
    kd, vd = be.upload_kv_cache(kn, vn, kv_layout="NHD")
    assert kd.kv_layout == "NHD" and kd.shape == kn.shape
    assert np.array_equal(kd.to_numpy(), kn) and np.array_equal(vd.to_numpy(), vn)
    rng = np.random.default_rng(0)
    new = rng.standard_normal((2, *kn.shape[1:])).astype(np.float32)  # [n, S, Hkv, D]
    be.update_pages(kd, vd, [3, 10], new, new[::-1])
    kn[[3, 10]], vn[[3, 10]] = new, new[::-1]
    assert np.array_equal(kd.to_numpy(), kn) and np.array_equal(vd.to_numpy(), vn)
    k2, v2 = be.upload_kv_cache(to_layout_back(kn), to_layout_back(vn))
    assert np.array_equal(psa.forward(q, kd, vd, **kw, kv_layout="NHD"), psa.forward(q, k2, v2, **kw))
    with pytest.raises(psa.SpecError, match=r"pages must be float32 \[1, 2, 3, 8\].*NHD.*\[R1\]"):
        be.update_pages(kd, vd, [0], k[:1], v[:1])  # an HND page


def to_layout_back(nhd: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(nhd.transpose(0, 2, 1, 3))


def test_R34_a_resident_cache_must_be_called_in_its_layout(WgpuBackend):
    be = WgpuBackend(required_limits="default")
    q, k, v, kw = _problem(7)
    knd, vnd = be.upload_kv_cache(to_layout(k, "NHD"), to_layout(v, "NHD"), kv_layout="NHD")
    with pytest.raises(psa.SpecError, match=r"k_cache is a device array uploaded with kv_layout='NHD'.*\[R34\]"):
        psa.forward(q, knd, vnd, **kw)
    kd, vd = be.upload_kv_cache(k, v)
    with pytest.raises(psa.SpecError, match=r"kv_layout='HND', the call has kv_layout='NHD'.*\[R34\]"):
        psa.forward(q, kd, vd, **kw, kv_layout="NHD")
    with pytest.raises(psa.SpecError, match=r"kv_layout must be .*got 'nhd' \[R34\]"):
        be.upload_kv_cache(k, v, kv_layout="nhd")
    plan = psa.plan_attention(kw["block_tables"], kw["cu_seqlens_q"], kw["used_kv_lens"], block_size=kw["block_size"],
                              page_size=2, num_q_heads=6, num_kv_heads=3, head_dim=8, kv_dtype=np.float32, topk=2,
                              kv_layout="NHD", backend=be)
    with pytest.raises(psa.SpecError, match=r"\[R34\]"):
        plan.run(q, kd, vd, kw["selected"])
    assert np.array_equal(plan.run(q, knd, vnd, kw["selected"]), psa.forward(q, kd, vd, **kw))


@pytest.mark.parametrize("binding", [256, None])
@pytest.mark.parametrize("shared", [True, False])
def test_R34_index_keys_in_nhd_give_the_same_scores_across_chunks(WgpuBackend, binding, shared):
    be = WgpuBackend(required_limits="default", **({"max_binding_size": binding} if binding else {}))
    q, k, v, kw = _problem(9)
    rng = np.random.default_rng(1)
    hk = 1 if shared else 3
    ik = rng.standard_normal((12, hk, 2, 4)).astype(np.float32)
    iq = rng.standard_normal((q.shape[0], 3, 4)).astype(np.float32)
    ikn = to_layout(ik, "NHD")
    args = (kw["block_tables"], kw["cu_seqlens_q"], kw["used_kv_lens"])
    a = block_scores(iq, ik, *args, block_size=4, backend=be)
    b = block_scores(iq, ikn, *args, block_size=4, kv_layout="NHD", backend=be)
    assert np.array_equal(a, b)
    ikd = be.upload_index_cache(ik)
    iknd = be.upload_index_cache(ikn, kv_layout="NHD")
    if binding:
        assert iknd.layout.n_chunks > 1
    assert np.array_equal(iknd.to_numpy(), ikn)
    c = block_scores(iq, ikd, *args, block_size=4)
    d = block_scores(iq, iknd, *args, block_size=4, kv_layout="NHD")
    assert np.array_equal(c, d)
    kn, vn = to_layout(k, "NHD"), to_layout(v, "NHD")
    sa = sparse_attention(q, k, v, iq, ik, *args[:2], used_kv_lens=args[2], block_size=4, topk=2, backend=be)
    sb = sparse_attention(q, kn, vn, iq, ikn, *args[:2], used_kv_lens=args[2], block_size=4, topk=2,
                          kv_layout="NHD", backend=be)
    assert np.array_equal(sa, sb)


@pytest.mark.parametrize("shared", [True, False])
def test_R34_R32_a_planned_msa_layer_on_resident_nhd_caches_gives_the_bits_of_hnd(WgpuBackend, shared):
    """The device runtime (one submission per layer, the inversion on the device) with NHD caches
    and index keys: run and run_sparse equal the HND plan's, device q included."""
    be = WgpuBackend(required_limits="default")
    q, k, v, kw = _problem(13)
    rng = np.random.default_rng(2)
    hk = 1 if shared else 3
    ik = rng.standard_normal((12, hk, 2, 4)).astype(np.float32)
    iq = rng.standard_normal((q.shape[0], 3, 4)).astype(np.float32)
    got = {}
    for lay in ("HND", "NHD"):
        kd, vd = be.upload_kv_cache(to_layout(k, lay), to_layout(v, lay), kv_layout=lay)
        ikd = be.upload_index_cache(to_layout(ik, lay), kv_layout=lay)
        plan = psa.plan_attention(kw["block_tables"], kw["cu_seqlens_q"], kw["used_kv_lens"], block_size=4, page_size=2,
                                  num_q_heads=6, num_kv_heads=3, head_dim=8, kv_dtype=np.float32, topk=2, causal=True,
                                  index_dim=4, num_index_heads=hk, kv_layout=lay, backend=be)
        dense = plan.run(q, kd, vd, kw["selected"], return_lse=True)
        msa = plan.run_sparse(q, kd, vd, iq, ikd, return_lse=True)
        on_device = plan.run(be.asarray(q), kd, vd, be.asarray(kw["selected"].astype(np.int32)))
        got[lay] = (*dense, *msa, on_device.numpy())
        plan.close()
    assert all(np.array_equal(a, b) for a, b in zip(got["HND"], got["NHD"]))
    ref, _ = psa.dense_reference(q, k, v, **kw, causal=True)
    assert np.allclose(got["NHD"][0], ref, atol=1e-5)


# (kernel, float16 variant, constants the host could pick): every kernel that reads a cache or index keys
_RH_PIPELINES = [
    ("psa_partials.wgsl", False, {"D": 8, "S": 2, "TK": 8, "RMAX": 8, "WG": 64, "TD": 2}),
    ("psa_partials.wgsl", True, {"D": 64, "S": 16, "TK": 16, "RMAX": 16, "WG": 64, "TD": 16}),
    ("psa_partials_decode.wgsl", True, {"D": 64, "S": 16, "NG": 8, "WG": 32, "TD": 16, "EU": 8, "R": 8, "SG": 32}),
    ("psa_block_scores.wgsl", False, {"DV": 2, "S": 4, "BS": 16, "DCV": 2, "RT": 8}),
    ("psa_block_scores_decode.wgsl", True, {"DV": 2, "S": 4, "BS": 16, "WG": 128, "NR": 8}),
    ("psa_block_scores_decode_sg.wgsl", False, {"DV": 32, "S": 4, "BS": 16, "EU": 8, "R": 16, "SG": 32, "WG": 128,
                                                "NR": 8}),
]


@pytest.mark.parametrize("kernel, f16, constants", _RH_PIPELINES, ids=lambda x: str(x)[:28])
def test_R34_the_nhd_pipelines_pass_tint(kernel, f16, constants, tint_device):
    """Each cache-reading kernel specialised for an NHD cache of 3 heads (RH = 3) is a valid
    pipeline under Tint (Dawn's Null adapter, no GPU); naga builds them in the tests above."""
    from paged_sparse_attn.backends.wgpu._kernels import kernel_source

    device, ctx = tint_device
    if f16 and "shader-f16" not in device.features:
        pytest.skip("Dawn's Null adapter has no shader-f16 here")
    module = device.create_shader_module(code=kernel_source(ctx, kernel, f16=f16), label=kernel)
    device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main",
                                                           "constants": {**constants, "RH": 3}})


def test_R34_the_sgmat_kernel_takes_rh_under_tint(tint_device):
    """The subgroup-matrix partials kernel declares RH too: with RH = 3 Tint refuses its pipeline
    only for the workgroup memory the host counts (the Null adapter allows 16 KiB), as without."""
    from types import SimpleNamespace

    from paged_sparse_attn.backends.wgpu import _sgmat
    from paged_sparse_attn.backends.wgpu._kernels import SGMAT_SHAPE, kernel_source

    ctx_geom = SimpleNamespace(sgmat=frozenset({SGMAT_SHAPE}), workgroup_storage=49152, max_invocations=1024,
                               subgroup=(32, ""))
    g = _sgmat.choose_sgmat_geometry(ctx_geom, D=64, S=16, G=8, block_size=64, rows_needed=8, kv_itemsize=2)
    device, ctx = tint_device
    module = device.create_shader_module(code=kernel_source(ctx, "psa_partials_sgmat.wgsl"), label="sgmat")
    with pytest.raises(Exception, match=rf"workgroup storage \({g.workgroup_bytes} bytes\)"):
        device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main",
                                                               "constants": {**g.constants(), "RH": 3}})
