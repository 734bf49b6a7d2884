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
    assert _why(ctx) is None
    g = _sgmat.choose_sgmat_geometry(ctx, D=128, S=64, G=8, block_size=128, rows_needed=32, kv_itemsize=2)
    assert (g.RMAX, g.TK, g.BK, g.WG) == (32, 32, 128, 256)
    assert g.kernel == "psa_partials_sgmat.wgsl" and g.kernel_name == g.kernel
    assert g.edges_per_item == 4 and g.heads_per_item == 8  # 4 queries x 8 heads share a K/V tile
    assert g.constants() == {"D": 128, "S": 64, "TK": 32, "BK": 128, "RMAX": 32, "WG": 256}
    assert g.workgroup_bytes <= 49152
    # (what Dawn reports for these constants: 45376 bytes)
    assert g.workgroup_bytes == 45376


@pytest.mark.parametrize("D, block_size, rows", [(16, 32, 240), (64, 64, 8), (128, 256, 32), (256, 64, 32),
                                                 (128, 128, 8), (32, 64, 64)])
def test_every_chosen_geometry_keeps_the_kernels_rules(D, block_size, rows):
    ctx = _ctx()
    assert _why(ctx, D=D, block_size=block_size, rows=rows) is None
    g = _sgmat.choose_sgmat_geometry(ctx, D=D, S=16, G=8, block_size=block_size, rows_needed=rows, kv_itemsize=2)
    HS, PB, SB = D + 8, g.BK + 8, max(g.BK, D) + 4
    nsg, nrb = g.WG // 32, g.RMAX // 16
    assert g.RMAX % 16 == 0 and g.TK % 16 == 0 and g.TK <= D and g.BK % g.TK == 0 and g.BK >= block_size
    assert nsg % nrb == 0 and (D // 16) % (nsg // nrb) == 0 and (D // 16) // (nsg // nrb) <= _sgmat.MAXDT
    # the split queries, then the block's split weights, in one area; the K/V tile after it
    assert 2 * g.RMAX * max(HS, PB) + g.TK * HS <= _sgmat.HCAP and g.RMAX * SB <= _sgmat.SCAP
    sl = g.WG // g.RMAX  # a row's softmax lanes: consecutive lanes of one subgroup (one butterfly)
    assert sl >= 1 and sl & (sl - 1) == 0 and sl <= 32
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
    for name in ("HCAP", "SCAP"):
        m = re.search(rf"const {name}: u32 = (\d+)u;", src)
        assert m and int(m.group(1)) == getattr(_sgmat, name), name
    assert "acc7" in src and "acc8" not in src and _sgmat.MAXDT == 8  # eight named accumulators
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


@pytest.mark.parametrize("D, block_size, rows", [(128, 128, 32), (64, 64, 8), (256, 64, 32), (16, 32, 240)])
def test_pipelines_with_the_hosts_constants_pass_tint_up_to_the_workgroup_memory_it_counts(D, block_size, rows,
                                                                                          tint_device):
    """Under Tint (Dawn's Null adapter, no GPU) the kernel with the constants the host picks is
    refused only for its workgroup memory, exactly the bytes ``sgmat_workgroup_bytes`` counts (the
    Null adapter allows 16 KiB; the kernel needs about 48)."""
    from paged_sparse_attn.backends.wgpu._kernels import kernel_source

    g = _sgmat.choose_sgmat_geometry(_ctx(), D=D, S=16, G=8, block_size=block_size, rows_needed=rows, kv_itemsize=2)
    device, ctx = tint_device
    module = device.create_shader_module(code=kernel_source(ctx, "psa_partials_sgmat.wgsl"), label="sgmat")
    assert g.WG <= dict(device.limits)["max-compute-invocations-per-workgroup"]
    with pytest.raises(Exception, match=rf"workgroup storage \({g.workgroup_bytes} bytes\)"):
        device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main",
                                                               "constants": g.constants()})


def test_batch_invariance_cannot_be_combined_with_the_sgmat_kernel(WgpuBackend):
    with pytest.raises(ValueError, match="batch_invariant=True runs the generic partials kernel.*'sgmat'"):
        WgpuBackend(required_limits="default", partials_kernel="sgmat", batch_invariant=True)
