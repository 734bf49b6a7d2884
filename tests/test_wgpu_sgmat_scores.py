"""The tensor-core block-score kernel (``psa_block_scores_sgmat.wgsl``): Tint compiles it, and the
host picks it exactly where it applies.

No device in CI runs subgroup matrices; numerics are checked on such a device by
``scripts/check_sgmat_scores.py``. Tint (Dawn's Null adapter) validates the shader and reports
the workgroup memory of its pipelines, which must equal the host's count.
"""

import re
from types import SimpleNamespace

import numpy as np
import pytest

from paged_sparse_attn.backends.wgpu._index_branch import (
    SCORES_SGMAT,
    SGMAT_SCORES_IPW,
    SGMAT_SCORES_NT,
    score_dispatches,
    sgmat_scores_constants,
    sgmat_scores_workgroup_bytes,
)
from paged_sparse_attn.backends.wgpu._kernels import KERNEL_TABLE, kernel_source
from paged_sparse_attn.errors import UnsupportedError


def _ctx(**kw):
    base = dict(sgmat=frozenset({(16, 16, 16), (16, 8, 16)}), subgroup=(32, ""), workgroup_storage=49152,
                max_invocations=1024)
    return SimpleNamespace(**{**base, **kw})


def _pick(ctx=None, **kw):
    args = dict(f16=True, d_idx=128, rows_per_seq=64, hnd=True, batch_invariant=False)
    return sgmat_scores_constants(ctx or _ctx(), **{**args, **kw})


def test_kernel_table_row_is_a_subgroup_matrix_drop_in_for_the_fma_kernel():
    row, fma = KERNEL_TABLE[SCORES_SGMAT], KERNEL_TABLE["psa_block_scores.wgsl"]
    assert row.sgmat and not fma.sgmat and not row.f16
    assert row.bindings == fma.bindings  # same bindings: the host planning is one code path


@pytest.mark.parametrize("rows, rt", [(9, 16), (16, 16), (17, 32), (33, 64), (64, 64), (65, 128), (200, 256),
                                      (5000, 256)])
def test_the_kernel_tile_covers_the_items_rows(rows, rt):
    geo, why = _pick(rows_per_seq=rows, choice="sgmat")
    assert geo == {"RT": rt, "NT": SGMAT_SCORES_NT, "IPW": SGMAT_SCORES_IPW, "NSG": max(4, rt // 16)}, why


@pytest.mark.parametrize("invocations, storage, rt", [(256, 49152, 128), (1024, 32768, 128), (128, 49152, 64),
                                                      (1024, 24000, 64)])
def test_items_shrink_to_the_workgroups_the_device_holds(invocations, storage, rt):
    """Items of 256 rows need 512 invocations and 37 KiB of workgroup memory: a device that
    holds less gets the largest items it holds (at least 64 rows, 4 subgroups)."""
    geo, why = _pick(_ctx(max_invocations=invocations, workgroup_storage=storage), rows_per_seq=4096)
    assert geo is not None, why
    assert (geo["RT"], geo["NSG"]) == (rt, rt // 16)
    assert 32 * geo["NSG"] <= max(128, invocations)
    assert sgmat_scores_workgroup_bytes(geo["NT"], geo["NSG"]) <= storage


def test_auto_follows_the_measured_choice(monkeypatch):
    """Where both apply, "auto" follows the measured choice (SGMAT_SCORES_AUTO), with a reason."""
    from paged_sparse_attn.backends.wgpu import _index_branch

    monkeypatch.setattr(_index_branch, "SGMAT_SCORES_AUTO", False)
    geo, why = _pick()
    assert geo is None and "turned off" in why
    monkeypatch.setattr(_index_branch, "SGMAT_SCORES_AUTO", True)
    assert _pick()[0]["RT"] == 64  # (rows_per_seq=64)


def test_subgroup_matrix_kernels_keep_workgroup_variables_16_byte_aligned():
    """Dawn on NVIDIA misplaced the matrix loads and stores of workgroup arrays that followed
    scalars adding up to 12 bytes (measured; docs/backends/dawn.md): in the subgroup-matrix
    kernels the scalar workgroup variables add up to a multiple of 16 bytes."""
    from paged_sparse_attn.backends.wgpu._shaders import shader_source

    scalar = re.compile(r"^var<workgroup>\s+\w+\s*:\s*(atomic<u32>|u32|i32|f32|vec2<\w+>)\s*;", re.M)
    sizes = {"atomic<u32>": 4, "u32": 4, "i32": 4, "f32": 4}
    for name, row in KERNEL_TABLE.items():
        if row.sgmat:
            total = sum(sizes.get(t, 8) for t in scalar.findall(shader_source(name)))
            assert total % 16 == 0, f"{name}: scalar workgroup variables of {total} bytes"


@pytest.mark.parametrize("kw, reason", [
    (dict(ctx=_ctx(sgmat=frozenset())), "subgroup matrices"),
    (dict(ctx=_ctx(sgmat=frozenset({(16, 8, 16)}))), "subgroup matrices"),
    (dict(f16=False), "float16"),
    (dict(hnd=False), "HND"),
    (dict(batch_invariant=True), "batch_invariant"),
    (dict(rows_per_seq=8), "decode"),
    (dict(d_idx=8), "d_idx"),
    (dict(d_idx=136), "d_idx"),
    (dict(d_idx=40), "multiple of 16"),
    (dict(page_size=8), "page size"),
    (dict(page_size=24), "page size"),
    (dict(block_size=8), "block size"),
    (dict(ctx=_ctx(subgroup=(64, ""))), "subgroup size"),
    (dict(ctx=_ctx(subgroup=(None, "not measured"))), "subgroup size"),
    (dict(ctx=_ctx(workgroup_storage=16384)), "workgroup memory"),
    (dict(choice="fma"), "FMA"),
])
def test_the_fma_kernel_runs_where_the_tensor_core_kernel_does_not_apply(kw, reason):
    geo, why = _pick(**kw)
    assert geo is None and reason in why


def test_forcing_the_tensor_core_kernel_where_it_cannot_run_raises():
    assert _pick(choice="sgmat")[0]["RT"] == 64
    with pytest.raises(UnsupportedError, match="HND"):
        _pick(hnd=False, choice="sgmat")


@pytest.mark.parametrize("rt, nt, ipw, dv", [(16, 2, 1, 32), (32, 2, 8, 4), (64, 4, 16, 16), (64, 2, 8, 32),
                                          (128, 2, 16, 32), (128, 1, 16, 32)])
def test_tint_compiles_it_with_the_workgroup_memory_the_host_counts(tint_device, rt, nt, ipw, dv):
    """The Null adapter allows 16 KiB of workgroup memory: the pipeline is refused with the
    byte count Tint computed from the shader, which must be the host's."""
    device, ctx = tint_device
    module = device.create_shader_module(code=kernel_source(ctx, SCORES_SGMAT))
    with pytest.raises(Exception) as err:
        device.create_compute_pipeline(layout="auto", compute={
            "module": module, "entry_point": "main",
            "constants": {"DV": dv, "S": 64, "BS": 128, "RT": rt, "NT": nt, "IPW": ipw, "NSG": max(4, rt // 16)}})
    used = re.search(r"workgroup storage \((\d+) bytes\)", str(err.value))
    assert used is not None, str(err.value)
    assert int(used.group(1)) == sgmat_scores_workgroup_bytes(nt, max(4, rt // 16))


def test_the_scores_kernel_option_is_checked_and_forcing_says_why(WgpuBackend):
    """``scores_kernel=`` is validated at construction; "sgmat" where the device has no subgroup
    matrices (lavapipe) raises UnsupportedError naming why (R18, no fallback); "fma" runs."""
    import numpy as np

    from paged_sparse_attn.index_branch import block_scores
    from test_index_branch import make_case, score_args

    with pytest.raises(ValueError, match="scores_kernel"):
        WgpuBackend(scores_kernel="tensor")
    with pytest.raises(ValueError, match="batch_invariant"):
        WgpuBackend(scores_kernel="sgmat", batch_invariant=True)
    c = make_case(5, B=1, S=16, ppb=1, msb=2, Hkv=2, d=16, T=[6], lens=[30], holes=0.0, dtype=np.float16)
    forced = WgpuBackend(required_limits="default", scores_kernel="sgmat")
    with pytest.raises(UnsupportedError, match="subgroup matrices"):
        block_scores(*score_args(c), block_size=c["block_size"], backend=forced)
    fma = WgpuBackend(required_limits="default", scores_kernel="fma")
    got = block_scores(*score_args(c), block_size=c["block_size"], backend=fma)
    want = block_scores(*score_args(c), block_size=c["block_size"], backend="numpy")
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    assert np.allclose(got, want, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("n, ipw, maxdim", [(1, 8, 65535), (17, 8, 65535), (64, 8, 65535), (1000, 16, 7),
                                            (50, 1, 4), (0, 8, 65535)])
def test_score_dispatches_give_every_item_to_one_workgroup(n, ipw, maxdim):
    """Workgroup w of a dispatch runs items item_base + w IPW .. + IPW - 1 below n_items: every
    item once, grids within the device's limit."""
    seen = []
    for base, cnt, gx, gy in score_dispatches(n, ipw, maxdim):
        assert gx <= maxdim and gy <= maxdim and 0 < cnt
        for w in range(gx * gy):
            seen += [base + i for i in range(w * ipw, min(w * ipw + ipw, cnt))]
    assert sorted(seen) == list(range(n))


def _order_key(x):
    """The kernel's order_key: float32 -> int32 order (-0 below +0) for finite x."""
    b = np.asarray(x, np.float32).view(np.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _logit_key(x):
    """The kernel's logit_key: float32 -> uint32 order, NaN above everything."""
    b = np.asarray(x, np.float32).view(np.uint32)
    k = np.where(b & 0x80000000, ~b, b | 0x80000000)
    return np.where((b & 0x7FFFFFFF) > 0x7F800000, 0xFFFFFFFF, k).astype(np.uint32)


@pytest.mark.parametrize("seed", range(6))
def test_the_fold_scaling_one_S_per_row_keeps_the_largest_logit_key(seed):
    """The fold of psa_block_scores_sgmat.wgsl keeps, for a nonzero scale, the largest order key of
    sgn S' over a row's positions and scales only that S': the largest key of scale (S' 2^-e)
    over the positions, bit for bit, because both float32 products round monotonically (signed
    zeros, subnormals and overflow to +-inf included). float32 arithmetic, as the kernel's."""
    rng = np.random.default_rng(seed)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 3e38, -3e38, 1.0, -1.0], np.float32)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        z = (rng.standard_normal(n) * np.float32(10.0) ** rng.integers(-30, 30)).astype(np.float32)
        pick = rng.random(n) < 0.3
        z[pick] = rng.choice(special, int(pick.sum()))
        us = np.float32(2.0) ** np.float32(rng.integers(-126, 114))  # 2^-e, e in [-113, 126]
        scale = np.float32(rng.choice([rng.standard_normal(), 1e-40, -1e-40, 3e38, -3e38, 0.088, -1.0]))
        if scale == 0:
            continue  # a zero scale keeps the per-position keys (0 * inf is NaN)
        with np.errstate(over="ignore", under="ignore"):
            want = _logit_key(scale * (z * us)).max()
            sgn = np.float32(-1.0 if scale < 0 else 1.0)
            k = _order_key(sgn * z).max()
            zm = sgn * np.array([k ^ ((k >> 31) & 0x7FFFFFFF)], np.int32).view(np.float32)[0]
            got = _logit_key(scale * (zm * us))
        assert got == want, (z, us, scale)
