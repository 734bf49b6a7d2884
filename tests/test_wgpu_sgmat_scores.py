"""Host selection of the tensor-core block-score kernel (``psa_block_scores_sgmat.wgsl``).

The kernel runs only on devices with f16 subgroup matrices (no such device in CI); these tests
check the host's choice and geometry, which need no device. Numerics are checked on such a device
by ``scripts/check_sgmat_scores.py``.
"""

from types import SimpleNamespace

import pytest

from paged_sparse_attn.backends.wgpu._index_branch import (
    SGMAT_MIN_DIM,
    sgmat_scores_geometry,
    sgmat_scores_workgroup_bytes,
)
from paged_sparse_attn.backends.wgpu._kernels import KERNEL_TABLE


def _ctx(**kw):
    base = dict(sgmat=frozenset({(16, 16, 16), (16, 8, 16)}), subgroup=(32, ""), workgroup_storage=49152)
    return SimpleNamespace(**{**base, **kw})


def test_kernel_table_row_is_a_subgroup_matrix_drop_in_for_the_fma_kernel():
    row, fma = KERNEL_TABLE["psa_block_scores_sgmat.wgsl"], KERNEL_TABLE["psa_block_scores.wgsl"]
    assert row.sgmat and not fma.sgmat
    assert row.bindings == fma.bindings  # same bindings: the host planning is one code path


@pytest.mark.parametrize("rt, want", [(8, (16, 1)), (16, (16, 1)), (32, (32, 2)), (64, (64, 2))])
def test_geometry_covers_the_items_rows(rt, want):
    geo, why = sgmat_scores_geometry(_ctx(), True, 128, rt)
    assert geo is not None, why
    assert (geo["RT"], geo["SR"]) == want and geo["RT"] >= rt
    assert geo["KD"] % 16 == 0 and sgmat_scores_workgroup_bytes(geo["KD"], geo["RT"]) <= 49152


@pytest.mark.parametrize("ctx, f16, d, bi, reason", [
    (_ctx(sgmat=frozenset()), True, 128, False, "subgroup matrices"),
    (_ctx(sgmat=frozenset({(16, 8, 16)})), True, 128, False, "subgroup matrices"),
    (_ctx(), False, 128, False, "float16"),
    (_ctx(), True, SGMAT_MIN_DIM - 1, False, "d_idx"),
    (_ctx(subgroup=(64, "")), True, 128, False, "subgroup size"),
    (_ctx(subgroup=(None, "not measured")), True, 128, False, "subgroup size"),
    (_ctx(workgroup_storage=8192), True, 128, False, "workgroup memory"),
    (_ctx(), True, 128, True, "batch_invariant"),
])
def test_the_fma_kernel_runs_when_the_tensor_core_kernel_does_not_apply(ctx, f16, d, bi, reason):
    geo, why = sgmat_scores_geometry(ctx, f16, d, 64, bi)
    assert geo is None and reason in why


def test_staging_shrinks_to_fit_the_workgroup_memory():
    small = sgmat_scores_geometry(_ctx(workgroup_storage=20480), True, 128, 16)[0]
    assert small is not None and small["KD"] < 64 and sgmat_scores_workgroup_bytes(small["KD"], 16) <= 20480
    assert sgmat_scores_geometry(_ctx(workgroup_storage=20480), True, 128, 64)[0] is None
    assert sgmat_scores_workgroup_bytes(16, 64) < sgmat_scores_workgroup_bytes(32, 64) < sgmat_scores_workgroup_bytes(64, 64)


def test_workgroup_bytes_match_the_shader_at_the_prefill_geometry():
    """The host's count equals the shader's variables (rounded to 16 bytes each), and the
    prefill geometry (64 rows, d_idx = 128) fits 48 KiB with 32 dims per step."""
    geo, why = sgmat_scores_geometry(_ctx(), True, 128, 64)
    assert geo == {"RT": 64, "SR": 2, "KD": 32}, why
    # qh, ql: 64 x 40 halves; ks: 128 x 40; res: 4 x 16 x 68 f32; kok; 6 row arrays; 3 flags
    assert sgmat_scores_workgroup_bytes(32, 64) == 2 * 5120 + 10240 + 17408 + 512 + 6 * 256 + 48
