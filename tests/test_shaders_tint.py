"""Every WGSL kernel compiles under Tint (Dawn's compiler) as well as under naga.

naga compiles them whenever the wgpu backend runs; Tint needs Dawn, which needs no GPU for this:
its Null adapter validates shaders and runs nothing. Where ``wgpudawn`` is missing the test is
skipped, except in continuous integration (``CI`` set), which installs it and must run it.
"""

import os

import pytest

from paged_sparse_attn.backends.wgpu._kernels import KERNEL_TABLE
from paged_sparse_attn.backends.wgpu._runtime import DAWN


def test_every_kernel_compiles_under_tint():
    if not DAWN.installed():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must check the shaders with Tint: {DAWN.install_hint}")
        pytest.skip(DAWN.install_hint)
    from paged_sparse_attn.backends.wgpu._shader_check import tint_check

    result = tint_check()
    # every kernel of the table was compiled, in each of its variants
    assert set(KERNEL_TABLE) <= set(result)
    assert {f"{n}[f16]" for n, row in KERNEL_TABLE.items() if row.f16} <= set(result)
    failed = {k: v.splitlines()[:3] for k, v in result.items() if v is not None}
    assert not failed, f"Tint rejects: {failed}"


def test_tint_check_reports_a_bad_shader(monkeypatch):
    """The check is not vacuous: a shader Tint rejects (a constant NaN) is reported."""
    if not DAWN.installed():
        pytest.skip(DAWN.install_hint)
    from paged_sparse_attn.backends.wgpu import _shader_check, _shaders

    bad = "@compute @workgroup_size(1) fn main() { let x = bitcast<f32>(0x7fc00000u); }"
    real = _shaders.shader_source
    monkeypatch.setattr(_shader_check, "EXTRA_SHADERS", (("bad.wgsl", False),))
    monkeypatch.setattr(_shaders, "shader_source", lambda n, **kw: bad if n == "bad.wgsl" else real(n, **kw))
    result = _shader_check.tint_check()
    assert result["bad.wgsl"] is not None and "nan" in result["bad.wgsl"].lower()
