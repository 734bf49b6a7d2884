"""The decode partials kernel of the wgpu backend (``psa_partials_decode.wgsl``).

Every test forces ``partials_kernel="decode"`` (so an ineligible problem fails instead of silently
running the generic kernel) and checks the kernel that ran from ``last_timings["kernel"]``.
Problems are decode problems: one query per sequence, so every (KV head, block) slot group has
exactly one edge. Devices use WebGPU's default limits (16 KiB workgroup memory). Tolerances
come from the dtype (R20).
"""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.errors import UnsupportedError

from paged_sparse_attn.testing import assert_attention_close, tolerance
from paged_sparse_attn.testing.generate import random_problem

DECODE = "psa_partials_decode.wgsl"
GENERIC = "psa_partials.wgsl"


@pytest.fixture(scope="module")
def dec(WgpuBackend):
    return WgpuBackend(required_limits="default", partials_kernel="decode")


@pytest.fixture(scope="module")
def gen(WgpuBackend):
    return WgpuBackend(required_limits="default", partials_kernel="generic")


@pytest.fixture(scope="module")
def dec_split(WgpuBackend):
    """Cache chunks of at most 4 KiB (blocks span chunks) and 2 x 2 workgroup grids."""
    return WgpuBackend(required_limits="default", partials_kernel="decode", max_binding_size=4096,
                       max_workgroups_per_dim=2)


def _index(pb):
    return pb.build_index()


def _check(pb, backend, kernel=DECODE):
    """backend == dense_reference and == numpy backend (dtype tolerance); returns (out, lse)."""
    dtype = pb.k_cache.dtype
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    out, lse = psa.forward(*pb.args, **pb.options, backend=backend, return_lse=True)
    if _index(pb).num_edges:
        assert backend.last_timings["kernel"] == kernel
    assert_attention_close(out, ref, dtype=dtype, lse=lse, ref_lse=ref_lse, err_msg="wgpu decode kernel")
    out_np, lse_np = psa.forward(*pb.args, **pb.options, backend="numpy", return_lse=True)
    atol = tolerance(np.float32).out * max(1.0, float(np.abs(out_np).max(initial=0.0)))
    np.testing.assert_allclose(out, out_np, rtol=0, atol=atol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_np))
    return out, lse


def _assert_partials_close(a, b):
    """Same empty rows (l == 0, m = -inf, o = 0); float32-close elsewhere (R14)."""
    np.testing.assert_array_equal(a.l == 0, b.l == 0)
    np.testing.assert_array_equal(np.isneginf(a.m), np.isneginf(b.m))
    empty = b.l == 0
    assert (a.o[empty] == 0).all() and (b.o[empty] == 0).all()
    tol = tolerance(np.float32).out
    np.testing.assert_allclose(a.m[~empty], b.m[~empty], rtol=tol, atol=tol)
    np.testing.assert_allclose(a.l[~empty], b.l[~empty], rtol=tol)
    np.testing.assert_allclose(a.o, b.o, rtol=0, atol=tol * max(1.0, float(np.abs(b.o).max(initial=0.0))))


# (G, D, page_size, pages per block, dtype): every G and D of the grid, every page size and
# block of 1..4 pages, both cache dtypes; the combinations keep lavapipe's compile count low.
GRID = [
    (1, 1, 1, 1, np.float32),
    (3, 5, 16, 2, np.float32),
    (8, 64, 16, 3, np.float16),
    (16, 128, 1, 4, np.float32),
    (8, 256, 64, 1, np.float16),
    (16, 5, 64, 2, np.float16),
    (3, 128, 16, 4, np.float16),
]


def _lanes_fit(backend, D, dtype) -> bool:
    """Whether a key group of this head dim fits the device's subgroups (lavapipe: 8 lanes, so
    rows of at most 8 units; NVIDIA: 32)."""
    from paged_sparse_attn.backends.wgpu._decode import decode_lanes

    size = backend.capabilities.limits.get("measured_subgroup_size")
    assert size is not None  # the devices tested (lavapipe, NVIDIA) have subgroups
    return decode_lanes(D, np.dtype(dtype).itemsize)[1] <= size


@pytest.mark.parametrize("G,D,S,ppb,dtype", GRID)
def test_R9_R10_R14_decode_kernel_matches_numpy_and_the_reference(dec, WgpuBackend, G, D, S, ppb, dtype):
    # one query per sequence (incl. an empty sequence); random L_b (not multiples of the page or
    # block), holes, -1 padding, rows that select nothing; unattended cells NaN/Inf-poisoned
    msb = 3 if S * ppb <= 64 else 2
    pb = random_problem(1000 + G * 7 + D + S + ppb, seqlens_q=(1, 1, 0, 1, 1), Hkv=2, G=G, D=D, page_size=S,
                      ppb=ppb, msb=msb, dtype=dtype, used="random", hole_prob=0.2, fill=0.7)
    pb.selected[1] = -1  # a query that selects nothing: an empty row
    if _lanes_fit(dec, D, dtype):
        _check(pb, dec)
    else:  # R18: refused when forced, naming why; "auto" runs the generic kernel
        with pytest.raises(UnsupportedError, match="decode.*subgroup size"):
            psa.forward(*pb.args, **pb.options, backend=dec)
        _check(pb, WgpuBackend(required_limits="default"), GENERIC)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_R14_blocks_of_several_tiles_rescale_the_running_softmax(WgpuBackend, dtype):
    # a 256-key block is walked in chunks of 4 keys per key group whose maxima differ (scale 1
    # spreads the scores); the running (m, l, o) must be rescaled between chunks
    be = WgpuBackend(required_limits="default", partials_kernel="decode", workgroup_size=64)
    pb = random_problem(41, seqlens_q=(1, 1, 1), Hkv=1, G=8, D=32, page_size=64, ppb=4, msb=2, dtype=dtype,
                      used=[512, 300, 130], hole_prob=0.1, fill=1.0, softmax_scale=1.0)
    _check(pb, be)
    assert be.last_timings["geometry"].TK < pb.block_size


def test_R9_lengths_not_multiples_of_page_or_block_and_past_length_poison(dec):
    pb = random_problem(77, seqlens_q=(1, 1, 1, 1), Hkv=1, G=8, D=64, page_size=16, ppb=3, msb=3,
                      dtype=np.float16, used=[1, 17, 33, 95], hole_prob=0.0, fill=1.0)
    assert pb.poisoned_cells > 0  # positions >= L_b hold NaN/Inf
    _check(pb, dec)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_R9_blocks_of_more_pages_than_lanes(dec, dtype):
    # 40 pages of 1 key per block: more than a key group's lanes (R <= 32), so rows are located
    # through the plan, not through the page list held in the lanes; holes included
    pb = random_problem(88, seqlens_q=(1, 1, 1), Hkv=1, G=4, D=16, page_size=1, ppb=40, msb=3, dtype=dtype,
                      used=[120, 81, 40], hole_prob=0.2, fill=1.0)
    _check(pb, dec)


def test_R12_logits_near_minus_1e6_are_exact(dec):
    # Integer data, scale 1: every score is -1e6 + j, exact in float32; one query per sequence.
    S, D, B, P = 4, 2, 3, 6
    rng = np.random.default_rng(12)
    k = np.zeros((P, 1, S, D), dtype=np.float32)
    k[..., 0] = -1000.0
    k[..., 1] = rng.integers(0, 6, size=(P, 1, S))
    v = rng.integers(-4, 5, size=(P, 1, S, D)).astype(np.float32)
    q = np.tile(np.array([1000.0, 1.0], dtype=np.float32), (B, 2, 1))
    bt = np.array([[2, 0], [3, 1], [5, 4]], dtype=np.int32)
    sel = np.array([[[0, 1]], [[1, -1]], [[0, 1]]], dtype=np.int32)
    args = (q, k, v, bt, sel, np.arange(B + 1, dtype=np.int32))
    kw = dict(block_size=S, softmax_scale=1.0, used_kv_lens=np.array([8, 7, 5], dtype=np.int32))
    ref, ref_lse = psa.dense_reference(*args, **kw)
    out, lse = psa.forward(*args, **kw, backend=dec, return_lse=True)
    assert dec.last_timings["kernel"] == DECODE
    assert (ref_lse < -9.9e5).all() and (np.abs(ref).max(axis=-1) > 0).all()
    assert_attention_close(out, ref, dtype=np.float32)
    ulp = float(np.spacing(np.float32(1e6)))
    assert np.abs(lse.astype(np.float64) - ref_lse).max() <= 2 * ulp


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_R14_split_bindings_and_small_grids(dec_split, dtype):
    # 4 KiB chunks: blocks of 4 pages span chunks (per-chunk pieces merged); 2 x 2 grids: many
    # dispatches and y > 0 workgroup ids
    pb = random_problem(31, seqlens_q=(1,) * 6, Hkv=2, G=3, D=24, page_size=8, ppb=4, msb=3, dtype=dtype,
                      used="random", hole_prob=0.15)
    _check(pb, dec_split)
    assert dec_split.last_timings["chunks"] > 1


def test_R14_forward_partials_equal_the_generic_kernel(dec, gen):
    pb = random_problem(5, seqlens_q=(1, 1, 1, 0, 1), Hkv=2, G=8, D=64, page_size=16, ppb=2, msb=3,
                      dtype=np.float16, used="random")
    idx = _index(pb)
    p_dec = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=dec)
    assert dec.last_timings["kernel"] == DECODE
    p_gen = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend=gen)
    assert gen.last_timings["kernel"] == GENERIC
    p_np = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, idx, backend="numpy")
    _assert_partials_close(p_dec, p_gen)
    _assert_partials_close(p_dec, p_np)


def test_R19_decode_kernel_is_bitwise_deterministic(dec):
    pb = random_problem(9, seqlens_q=(1, 1, 1), Hkv=2, G=16, D=64, page_size=16, ppb=4, msb=2,
                      dtype=np.float16, used="full", hole_prob=0.1)
    a, la = psa.forward(*pb.args, **pb.options, backend=dec, return_lse=True)
    for _ in range(2):
        b, lb = psa.forward(*pb.args, **pb.options, backend=dec, return_lse=True)
        assert a.tobytes() == b.tobytes() and la.tobytes() == lb.tobytes()


def test_auto_picks_decode_for_one_query_per_sequence_and_generic_otherwise(WgpuBackend):
    auto = WgpuBackend(required_limits="default")
    pb = random_problem(3, seqlens_q=(1, 1), Hkv=1, G=8, D=16, page_size=4, ppb=2, msb=3, used="full", fill=1.0)
    _check(pb, auto, DECODE)
    # two queries of one sequence select the same block: a slot group with two edges
    pf = random_problem(3, seqlens_q=(2, 1), Hkv=1, G=8, D=16, page_size=4, ppb=2, msb=3, used="full", fill=1.0)
    assert np.diff(_index(pf).slot_ptr).max() > 1
    _check(pf, auto, GENERIC)


def test_R18_forced_decode_on_a_prefill_problem_raises_naming_why(dec):
    pf = random_problem(3, seqlens_q=(2, 1), Hkv=1, G=4, D=8, page_size=4, ppb=2, msb=3, used="full", fill=1.0)
    with pytest.raises(UnsupportedError, match="decode.*one query"):
        psa.forward(*pf.args, **pf.options, backend=dec)


def test_R18_float16_rows_of_half_units_run_the_generic_kernel_or_raise_when_forced(WgpuBackend, dec):
    # head_dim 12 in float16: a row is 3 vec4s = 24 bytes, not whole 16-byte units
    pb = random_problem(12, seqlens_q=(1, 1), Hkv=1, G=4, D=12, page_size=4, ppb=2, msb=3, used="full",
                      dtype=np.float16)
    _check(pb, WgpuBackend(required_limits="default"), GENERIC)
    with pytest.raises(UnsupportedError, match="decode.*24 bytes, not whole 16-byte units"):
        psa.forward(*pb.args, **pb.options, backend=dec)


def test_partials_kernel_option_is_validated(WgpuBackend):
    with pytest.raises(ValueError, match="partials_kernel"):
        WgpuBackend(required_limits="default", partials_kernel="fast")


def test_profile_forward_kernel_override_times_both_kernels(WgpuBackend):
    from paged_sparse_attn._validation import validate_forward

    be = WgpuBackend(required_limits="default")
    pb = random_problem(4, seqlens_q=(1, 1, 1), Hkv=2, G=8, D=16, page_size=4, ppb=2, msb=3, used="full")
    p = validate_forward("bench", *pb.args, **pb.options)
    idx = _index(pb)
    auto = be.profile_forward(p, idx, repeat=1)
    generic = be.profile_forward(p, idx, repeat=1, kernel="generic")
    assert auto["kernel"] == DECODE and generic["kernel"] == GENERIC
    assert auto["total_s"] > 0 and generic["total_s"] > 0
    # the override ends with the call
    psa.forward(*pb.args, **pb.options, backend=be)
    assert be.last_timings["kernel"] == DECODE
    with pytest.raises(ValueError, match="kernel"):
        be.profile_forward(p, idx, repeat=1, kernel="fast")


@pytest.mark.parametrize("pf", [False, True])
@pytest.mark.parametrize("wg", [8, 32, 128])
@pytest.mark.parametrize("D,dtype", [(32, np.float32), (64, np.float16), (8, np.float16)])
def test_R9_R14_R19_decode_kernel_key_groups_merge(WgpuBackend, wg, D, dtype, pf):
    """One to many key groups per workgroup (WG / R): the groups' (m, l, o) are merged by their
    log-sum-exp weights; every split matches the reference and is deterministic, with and
    without the next chunk's loads in flight."""
    be = WgpuBackend(partials_kernel="decode", decode_workgroup_size=wg, decode_prefetch=pf)
    pb = random_problem(31 + wg + D, seqlens_q=(1, 1, 1), G=8, D=D, page_size=8, ppb=4, msb=4, dtype=dtype,
                      used=[128, 77, 5], hole_prob=0.2)
    assert _index(pb).num_edges > 0
    out, lse = _check(pb, be)
    g = be.last_timings["geometry"]
    assert g.WG >= wg and g.WG % g.R == 0 and g.PF == int(pf)
    again, lse2 = psa.forward(*pb.args, **pb.options, backend=be, return_lse=True)
    assert out.tobytes() == again.tobytes() and lse.tobytes() == lse2.tobytes()


def test_R18_subgroup_size_is_measured_once_per_device(WgpuBackend):
    from paged_sparse_attn.backends.wgpu._device import subgroup_size

    ctx = WgpuBackend(required_limits="default").device_context
    size, why = subgroup_size(ctx)
    assert why == "" and size >= 8 and size & (size - 1) == 0  # lavapipe 8, NVIDIA 32
    assert subgroup_size(ctx) is ctx.subgroup  # measured once, then kept


def test_R18_without_the_subgroup_feature_decode_is_refused_and_auto_runs_generic(WgpuBackend):
    pb = random_problem(21, seqlens_q=(1, 1), Hkv=1, G=4, D=16, page_size=4, ppb=2, msb=3, used="full")
    forced = WgpuBackend(required_limits="default", partials_kernel="decode", disable_features=("subgroup",))
    with pytest.raises(UnsupportedError, match="decode.*lacks the subgroup feature"):
        psa.forward(*pb.args, **pb.options, backend=forced)
    _check(pb, WgpuBackend(required_limits="default", disable_features=("subgroup",)), GENERIC)


def test_decode_kernel_with_subgroups_wider_than_a_key_group(WgpuBackend):
    """Key groups narrower than a subgroup are merged with shuffles inside the subgroup (R < SG).
    NVIDIA (32 lanes) runs that path in the tests above; lavapipe's subgroups are 8 lanes, as
    narrow as a key group, so there the grid is run again in a process where llvmpipe uses
    512-bit vectors (Mesa's LP_NATIVE_VECTOR_WIDTH): 16-lane subgroups."""
    import os
    import subprocess
    import sys

    be = WgpuBackend(required_limits="default")
    size = be.capabilities.limits.get("measured_subgroup_size")
    if "llvmpipe" not in be.device_summary:
        assert size is not None and size > 8  # this device's own run covers R < SG
        return
    env = {**os.environ, "LP_NATIVE_VECTOR_WIDTH": "512"}
    probe = subprocess.run([sys.executable, "-c", (
        "from paged_sparse_attn.backends.wgpu import WgpuBackend;"
        "print(WgpuBackend().capabilities.limits['measured_subgroup_size'])")], env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and probe.stdout.strip().splitlines()[-1] == "16", probe.stdout + probe.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "matches_numpy or key_groups or more_pages or deterministic or tiles"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
