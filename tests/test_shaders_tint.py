"""Every WGSL kernel compiles under Tint (Dawn's compiler) as well as under naga.

naga compiles them whenever the wgpu backend runs; Tint needs Dawn, which needs no GPU for this:
its Null adapter validates shaders and runs nothing. Where ``wgpudawn`` is missing the test is
skipped, except in continuous integration (``CI`` set), which installs it and must run it.
"""

import pytest

from paged_sparse_attn.backends.wgpu._kernels import KERNEL_TABLE


def test_every_kernel_compiles_under_tint(dawn_runtime):
    from paged_sparse_attn.backends.wgpu._shader_check import tint_check

    result = tint_check()
    # every kernel of the table was compiled, in each of its variants
    assert set(KERNEL_TABLE) <= set(result)
    assert {f"{n}[f16]" for n, row in KERNEL_TABLE.items() if row.f16} <= set(result)
    failed = {k: v.splitlines()[:3] for k, v in result.items() if v is not None}
    assert not failed, f"Tint rejects: {failed}"


def test_tint_check_reports_a_bad_shader(monkeypatch, dawn_runtime):
    """The check is not vacuous: a shader Tint rejects (a constant NaN) is reported."""
    from paged_sparse_attn.backends.wgpu import _shader_check, _shaders

    bad = "@compute @workgroup_size(1) fn main() { let x = bitcast<f32>(0x7fc00000u); }"
    real = _shaders.shader_source
    monkeypatch.setattr(_shader_check, "EXTRA_SHADERS", (("bad.wgsl", False),))
    monkeypatch.setattr(_shaders, "shader_source", lambda n, **kw: bad if n == "bad.wgsl" else real(n, **kw))
    result = _shader_check.tint_check()
    assert result["bad.wgsl"] is not None and "nan" in result["bad.wgsl"].lower()


def test_gemm_variants_create_pipelines_with_the_workgroup_memory_the_host_counts(tint_device):
    """Every GEMM variant of the matmul ceiling is a valid pipeline under Tint where it fits
    Dawn's Null adapter (16 KiB of workgroup memory, 256 invocations); larger ones are refused
    with exactly the workgroup memory ``GemmVariant.workgroup_bytes`` counts (the host skips
    them by that count on devices with less)."""
    from paged_sparse_attn.backends.wgpu._ceilings import GEMM_VARIANTS
    from paged_sparse_attn.backends.wgpu._kernels import kernel_source

    device, ctx = tint_device
    lim = dict(device.limits)
    tiled = [v for v in GEMM_VARIANTS if v.tiled]
    assert tiled and any(v.workgroup_bytes <= lim["max-compute-workgroup-storage-size"] for v in tiled)
    modules = {}
    for v in tiled:
        if v.kernel not in modules:
            modules[v.kernel] = device.create_shader_module(code=kernel_source(ctx, v.kernel), label=v.kernel)
        assert v.invocations <= lim["max-compute-invocations-per-workgroup"]
        desc = {"module": modules[v.kernel], "entry_point": "main", "constants": v.c}
        if v.workgroup_bytes <= lim["max-compute-workgroup-storage-size"]:
            device.create_compute_pipeline(layout="auto", compute=desc)
        else:
            with pytest.raises(Exception, match=rf"\({v.workgroup_bytes} bytes\)"):
                device.create_compute_pipeline(layout="auto", compute=desc)


def test_gemm_error_bound_passes_the_exact_product_and_fails_a_lost_k_step():
    """The check of the matmul ceiling: float32 accumulations of the exact float16 products pass
    (ascending and blocked by 16, like tensor cores), a product that lost one K step of 16 or
    carries one wrong element does not."""
    import numpy as np

    from paged_sparse_attn.backends.wgpu._ceilings import check_rows, gemm_error_bound

    rng = np.random.default_rng(3)
    m, n, k = 256, 64, 512
    a = (rng.standard_normal((m, k)) * 0.1).astype(np.float16)
    b = (rng.standard_normal((k, n)) * 0.1).astype(np.float16)
    rows = check_rows(m)
    assert len(set(rows.tolist())) == 64 and rows.max() < m and len({int(r) % 16 for r in rows}) > 8
    ref, bound = gemm_error_bound(a[rows], b)
    a32, b32 = a[rows].astype(np.float32), b.astype(np.float32)
    seq = np.zeros((len(rows), n), np.float32)
    for j in range(k):  # one float32 rounding per term
        seq += a32[:, j:j + 1] * b32[j:j + 1, :]
    blocked = np.zeros_like(seq)
    for j in range(0, k, 16):
        blocked += a32[:, j:j + 16] @ b32[j:j + 16]
    for c in (seq, blocked, (a32 @ b32)):
        assert np.all(np.abs(c - ref) <= bound)
    lost = blocked - a32[:, 16:32] @ b32[16:32]
    assert not np.all(np.abs(lost - ref) <= bound)
    one = blocked.copy()
    one[5, 7] += 100 * bound[5, 7] + 1e-6
    assert not np.all(np.abs(one - ref) <= bound)
    nan = blocked.copy()
    nan[0, 0] = np.nan
    assert not np.all(np.abs(nan - ref) <= bound)


def test_a_gemm_variant_whose_pipeline_the_runtime_refuses_is_skipped_with_its_reason(tint_device, monkeypatch):
    """The tiled GEMM loads float16 matrices from 16-byte words, which a runtime may refuse: a
    variant whose pipeline is refused is a skipped row carrying the runtime's message, not an
    exception, and with every variant refused ``matmul_rate`` raises ``UnsupportedError`` listing
    why, not a rate."""
    from types import SimpleNamespace

    from paged_sparse_attn import DeviceError, UnsupportedError
    from paged_sparse_attn.backends.wgpu import _ceilings, _kernels

    device, ctx = tint_device
    lim = dict(device.limits)
    ctx = SimpleNamespace(**vars(ctx), device=device, subgroup=(32, ""),
                          workgroup_storage=lim["max-compute-workgroup-storage-size"],
                          max_invocations=lim["max-compute-invocations-per-workgroup"])

    def refuse(ctx, kernel, constants, **kw):
        raise DeviceError(f"WGSL backend: pipeline creation of {kernel}:main failed (GPUValidationError): "
                          "no matching call to 'subgroupMatrixLoad'")

    monkeypatch.setattr(_kernels, "pipeline", refuse)
    rows = _ceilings.matmul_variants(ctx, 256, repeat=1)
    assert rows and all(r["skipped"] for r in rows)
    fitting = [r for r in rows if "refuses its pipeline" in r["skipped"]]
    assert fitting and all("no matching call to 'subgroupMatrixLoad'" in r["skipped"] for r in fitting)
    assert all("flop_per_s" not in r for r in rows)
    with pytest.raises(UnsupportedError, match="refuses its pipeline"):
        _ceilings.matmul_rate(ctx, 256, repeat=1)
