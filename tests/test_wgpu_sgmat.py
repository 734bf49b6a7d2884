"""The subgroup-matrix partials kernel of the wgpu backend (``psa_partials_sgmat.wgsl``): its host side.

The kernel itself runs only where the device has 16x16x16 float16 subgroup matrices (Dawn on a
GPU with tensor cores); ``scripts/check_sgmat_partials.py`` checks it there. These tests check
what every machine can: the geometry the host picks and when, that the shader's constant
capacities match the host's, and that a device without subgroup matrices refuses the kernel
(and runs the FMA kernel under ``"auto"``).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends.wgpu import _sgmat
from paged_sparse_attn.backends.wgpu._kernels import KERNEL_TABLE
from paged_sparse_attn.errors import UnsupportedError
from paged_sparse_attn.testing import assert_attention_close
from paged_sparse_attn.testing.generate import random_problem

SHADER = Path(__file__).resolve().parents[1] / "shaders" / "psa_partials_sgmat.wgsl"


def _ctx(**over):
    """A device context as the geometry sees it: the H200 through Dawn unless overridden."""
    base = {"sgmat": frozenset({(16, 16, 16), (16, 8, 16), (16, 8, 8)}), "workgroup_storage": 49152,
            "max_invocations": 1024, "subgroup": (32, "")}
    return SimpleNamespace(**{**base, **over})


def _why(ctx=None, *, D=128, itemsize=2, block_size=128, rows=32):
    return _sgmat.sgmat_ineligible(ctx or _ctx(), D=D, kv_itemsize=itemsize, block_size=block_size,
                                   rows_needed=rows)


def test_msa_prefill_geometry_fills_the_workgroup_memory():
    ctx = _ctx()
    assert _why(ctx, rows=2048) is None
    g = _sgmat.choose_sgmat_geometry(ctx, D=128, S=64, G=8, block_size=128, rows_needed=2048, kv_itemsize=2)
    assert (g.RMAX, g.TK, g.BK, g.WG) == (64, 32, 128, 512)
    assert g.kernel == "psa_partials_sgmat.wgsl" and g.kernel_name == g.kernel
    assert g.edges_per_item == 8 and g.heads_per_item == 8  # 8 queries x 8 heads share a K/V tile
    assert g.constants() == {"D": 128, "S": 64, "TK": 32, "BK": 128, "RMAX": 64, "WG": 512,
                             "NPW": _sgmat.PERSISTENT_WORKGROUPS}
    assert g.max_workgroups == _sgmat.PERSISTENT_WORKGROUPS  # (its workgroups loop over items)
    # the largest geometry is what the word array holds, within 48 KiB (each variable rounded to
    # 16 bytes, as Dawn counted them when it reported 48704 bytes for the kernel's variables
    # before its row arrays moved into the word array and its flags into two vec4<u32>)
    assert _sgmat.sgmat_words(128, 64, 32, 128) == _sgmat.WCAP
    assert g.workgroup_bytes == 47648 <= 49152
    # an item that can hold 32 rows gets 32
    g32 = _sgmat.choose_sgmat_geometry(ctx, D=128, S=64, G=8, block_size=128, rows_needed=32, kv_itemsize=2)
    assert (g32.RMAX, g32.TK, g32.BK, g32.WG) == (32, 32, 128, 256) and g32.edges_per_item == 4


@pytest.mark.parametrize("D, block_size, rows", [(16, 32, 240), (64, 64, 8), (128, 256, 32), (256, 64, 32),
                                                 (128, 128, 8), (32, 64, 64), (128, 128, 2048), (128, 200, 64),
                                                 (64, 8, 64), (16, 4, 8)])
def test_every_chosen_geometry_keeps_the_kernels_rules(D, block_size, rows):
    ctx = _ctx()
    assert _why(ctx, D=D, block_size=block_size, rows=rows) is None
    g = _sgmat.choose_sgmat_geometry(ctx, D=D, S=16, G=8, block_size=block_size, rows_needed=rows, kv_itemsize=2)
    nsg, nrb = g.WG // 32, g.RMAX // 16
    assert g.RMAX % 16 == 0 and g.TK % 16 == 0 and g.TK <= D and g.BK % g.TK == 0 and g.BK >= block_size
    assert nsg % nrb == 0 and (D // 16) % (nsg // nrb) == 0 and (D // 16) // (nsg // nrb) <= _sgmat.MAXDT
    sl = g.WG // g.RMAX  # a row's softmax lanes: consecutive lanes of one subgroup (one butterfly)
    assert sl >= 1 and sl & (sl - 1) == 0 and sl <= 32
    # each row's words (its split query, scores, split weights and a bit of each code per
    # position, o), then the K/V tile
    pw = max(D, g.BK) // 8 + -(-g.BK // 128)
    assert g.RMAX * (2 * pw + 1) + g.TK * (D // 8 + 1) <= _sgmat.WCAP
    # each lane's positions: whole words of weights, their scores in registers, their code bits
    # within one u32
    nk = g.BK // sl
    assert g.BK % sl == 0 and nk in (8, 16, 32) and _sgmat.NK_CHOICES == (8, 16, 32)
    assert -(-g.TK * D // 8 // g.WG) <= _sgmat.MAXLD and -(-g.RMAX * D // 4 // g.WG) <= _sgmat.MAXLD
    assert g.workgroup_bytes <= ctx.workgroup_storage and g.WG <= ctx.max_invocations


@pytest.mark.parametrize("ctx, kw, why", [
    (_ctx(sgmat=frozenset()), {}, "no 16x16x16"),
    (_ctx(sgmat=frozenset({(16, 8, 16)})), {}, "no 16x16x16"),
    (_ctx(), {"itemsize": 4}, "not float16"),
    (_ctx(), {"D": 8}, "multiple of 16"),
    (_ctx(), {"D": 272}, "multiple of 16 up to 256"),
    (_ctx(subgroup=(64, "")), {}, "subgroup size is 64"),
    (_ctx(workgroup_storage=16384), {}, "fits 16384 bytes"),
    (_ctx(), {"block_size": 1024}, "blocks of 1024"),
])
def test_when_the_kernel_does_not_apply_the_host_says_why(ctx, kw, why):
    assert why in _why(ctx, **kw)


def test_shader_capacities_match_the_host():
    src = SHADER.read_text()
    m = re.search(r"const WCAP: u32 = (\d+)u;", src)
    assert m and int(m.group(1)) == _sgmat.WCAP
    assert "acc7" in src and "acc8" not in src and _sgmat.MAXDT == 8  # eight named accumulators
    # sixteen pairs of named query matrices: head dims up to 256
    assert "qh15" in src and "qh16" not in src and _sgmat.MAX_HEAD_DIM == 256
    assert not re.search(r"^\s*enable ", src, re.MULTILINE)  # the loader prepends the enables
    row = KERNEL_TABLE["psa_partials_sgmat.wgsl"]
    assert row.sgmat and row.bindings == KERNEL_TABLE["psa_partials.wgsl"].bindings


def test_a_device_without_subgroup_matrices_refuses_the_kernel_and_auto_runs_the_fma_kernel(WgpuBackend):
    pb = random_problem(3, seqlens_q=(5, 3), Hkv=2, G=8, D=16, page_size=4, ppb=2, msb=3, causal=True,
                        dtype=np.float16, q_dtype=np.float32)
    forced = WgpuBackend(required_limits="default", partials_kernel="sgmat")
    with pytest.raises(UnsupportedError, match="subgroup-matrix partials kernel.*no 16x16x16"):
        psa.forward(*pb.args, **pb.options, backend=forced)
    auto = WgpuBackend(required_limits="default")
    out, lse = psa.forward(*pb.args, **pb.options, backend=auto, return_lse=True)
    assert auto.last_timings["kernel"] == "psa_partials.wgsl"
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    assert_attention_close(out, ref, dtype=np.float16, lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("D, block_size, rows", [(128, 128, 32), (64, 64, 8), (256, 64, 32), (16, 32, 240),
                                                 (128, 128, 2048), (128, 200, 64), (16, 4, 8)])
def test_pipelines_with_the_hosts_constants_pass_tint_up_to_the_workgroup_memory_it_counts(D, block_size, rows,
                                                                                          tint_device):
    """Under Tint (Dawn's Null adapter, no GPU) the kernel with the constants the host picks is
    refused only for its workgroup memory, exactly the bytes ``sgmat_workgroup_bytes`` counts (the
    Null adapter allows 16 KiB; the kernel needs about 48)."""
    from paged_sparse_attn.backends.wgpu._kernels import kernel_source

    device, ctx = tint_device
    # (the Null adapter allows 256 invocations: the geometry the host picks there)
    lim = dict(device.limits)["max-compute-invocations-per-workgroup"]
    g = _sgmat.choose_sgmat_geometry(_ctx(max_invocations=lim), D=D, S=16, G=8, block_size=block_size,
                                     rows_needed=rows, kv_itemsize=2)
    module = device.create_shader_module(code=kernel_source(ctx, "psa_partials_sgmat.wgsl"), label="sgmat")
    assert g.WG <= dict(device.limits)["max-compute-invocations-per-workgroup"]
    with pytest.raises(Exception, match=rf"workgroup storage \({g.workgroup_bytes} bytes\)"):
        device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main",
                                                               "constants": g.constants()})


def test_batch_invariance_cannot_be_combined_with_the_sgmat_kernel(WgpuBackend):
    with pytest.raises(ValueError, match="batch_invariant=True runs the generic partials kernel.*'sgmat'"):
        WgpuBackend(required_limits="default", partials_kernel="sgmat", batch_invariant=True)


@pytest.mark.psa_backends(exclude=("numpy",))
@pytest.mark.parametrize("seed, D, page_size, ppb, G, seqlens", [
    (11, 128, 8, 25, 8, (40, 3)),   # blocks of 200 positions: BK rounded up to 256, items of 32 rows
    (12, 16, 2, 2, 8, (30,)),       # D = 16, blocks of 4: items of 64 rows, one 16-position tile
    (13, 64, 16, 4, 8, (50, 20)),   # items of 64 rows, blocks of 64
    (14, 256, 16, 4, 4, (24, 9)),   # D = 256: sixteen pairs of query matrices
    (15, 64, 32, 8, 8, (40, 12)),   # blocks of 256 in pages of 32: a softmax lane's 32 positions
                                    # in one page (one lookup a lane; seeds 11 and 12 look up each position)
    (16, 96, 16, 4, 8, (30, 10)),   # D = 96: a query row's 24 units are not a power of two (its
                                    # maximum folded by atomics; 16 and 64 by shuffles, 256 by atomics)
])
def test_the_sgmat_kernel_on_its_geometries_matches_the_reference_and_the_fma_kernels_special_values(
        backend, seed, D, page_size, ppb, G, seqlens):
    """On a device with subgroup matrices, the tensor-core partials (``partials_kernel="sgmat"``)
    on geometries the host picks for odd blocks, head dims 16 to 256 and items of 64 rows: within
    R20 of the float64 reference, with the NaN / +-Inf of the problem's poisoned cache positions
    exactly where the FMA kernel puts them."""
    if (16, 16, 16) not in backend.device_context.sgmat:
        pytest.skip(f"backend {backend.name!r}: the device has no 16x16x16 float16 subgroup matrices")
    pb = random_problem(seed, seqlens_q=seqlens, Hkv=2, G=G, D=D, page_size=page_size, ppb=ppb, msb=3,
                        causal=True, dtype=np.float16, q_dtype=np.float32)
    runs = {}
    for kernel in ("sgmat", "generic"):
        be = type(backend)(partials_kernel=kernel)
        try:
            runs[kernel] = psa.forward(*pb.args, **pb.options, backend=be, return_lse=True)
            assert be.last_timings["kernel"] == ("psa_partials_sgmat.wgsl" if kernel == "sgmat" else "psa_partials.wgsl")
        finally:
            be.close()
    out, lse = runs["sgmat"]
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    assert_attention_close(out, ref, dtype=np.float16, lse=lse, ref_lse=ref_lse)
    fma_out, fma_lse = runs["generic"]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(fma_out))
    np.testing.assert_array_equal(np.isposinf(out), np.isposinf(fma_out))
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(fma_out))


@pytest.mark.psa_backends(exclude=("numpy",))
@pytest.mark.parametrize("seed, D, page_size, ppb, G, seqlens", [
    (21, 64, 16, 4, 8, (50, 20)),   # items of 64 rows, blocks of 64
    (22, 128, 8, 25, 8, (40, 3)),   # blocks of 200 positions: BK 256, items of 32 rows
    (23, 96, 16, 4, 8, (40, 12)),   # the rows' maxima by atomics, cleared between items
])
def test_workgroups_that_loop_over_items_give_the_bits_of_one_workgroup_per_item(
        backend, monkeypatch, seed, D, page_size, ppb, G, seqlens):
    """The tensor-core partials' workgroups loop over items (every NPW-th), reading the next
    item while they work on one: with 3 workgroups each runs many items of this problem (the
    next item's rows, pages, first K tile and queries taken over from the item before it), with
    the default every item has a workgroup of its own. Both the host-planned path (``forward``)
    and a plan on device-resident caches (its dispatch sized on the device) give the same bits
    either way, NaN / +-inf of the poisoned cache positions included."""
    if (16, 16, 16) not in backend.device_context.sgmat:
        pytest.skip(f"backend {backend.name!r}: the device has no 16x16x16 float16 subgroup matrices")
    pb = random_problem(seed, seqlens_q=seqlens, Hkv=2, G=G, D=D, page_size=page_size, ppb=ppb, msb=3,
                        causal=True, dtype=np.float16, q_dtype=np.float32)
    q, k, v, bt, sel, cu = (np.array(x) for x in pb.args)
    # special values in items of every workgroup: +inf values in head 0 of every page of the first
    # sequence, NaN keys in head 1 of its pages, and a query row of +inf (its item on FMA scores)
    v[bt[0][bt[0] >= 0], 0, 0, 0] = np.inf
    k[bt[0][bt[0] >= 0], 1, 1, 0] = np.nan
    q[len(q) - 1, 0, :] = np.inf
    args = (q, k, v, bt, sel, cu)
    runs = {}
    for npw in (_sgmat.PERSISTENT_WORKGROUPS, 3):
        monkeypatch.setattr(_sgmat, "PERSISTENT_WORKGROUPS", npw)
        be = type(backend)(partials_kernel="sgmat")
        try:
            out = psa.forward(*args, **pb.options, backend=be, return_lse=True)
            assert be.last_timings["kernel"] == "psa_partials_sgmat.wgsl"
            kd, vd = be.upload_kv_cache(k, v)
            plan = psa.plan_attention(bt, cu, pb.options["used_kv_lens"], block_size=pb.options["block_size"],
                                      page_size=page_size, num_q_heads=q.shape[1], num_kv_heads=k.shape[1],
                                      head_dim=D, kv_dtype=k.dtype, topk=sel.shape[2], causal=True,
                                      softmax_scale=pb.options.get("softmax_scale"), backend=be)
            runs[npw] = (*out, plan.run(q, kd, vd, sel))
            assert plan._runtime.geom.max_workgroups == npw
        finally:
            be.close()
    (o1, l1, p1), (o2, l2, p2) = runs.values()
    assert o1.tobytes() == o2.tobytes() and l1.tobytes() == l2.tobytes() and p1.tobytes() == p2.tobytes()
    assert p1.tobytes() == o1.tobytes()  # (the plan runs the same kernel as forward)
    assert np.isnan(o1).any() and np.isinf(o1).any() and np.isfinite(o1).any()
