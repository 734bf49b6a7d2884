"""The kernel versions of ``scripts/experiment_partials_variants.py`` still apply to the kernels
and compile under Tint, so that the measurements the benchmarks page reports can be run again.

Each version is an edit of a kernel's text that must match it exactly; a change of the kernel
that breaks an edit fails here, not on the GPU machine.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _variants():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("experiment_partials_variants",
                                                      SCRIPTS / "experiment_partials_variants.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPTS))
    return mod


V = _variants()


@pytest.mark.parametrize("name", sorted(V.VERSIONS))
def test_each_version_edits_its_kernel_and_compiles_under_tint(name, tint_device):
    from paged_sparse_attn.backends.wgpu._kernels import kernel_source
    from paged_sparse_attn.backends.wgpu._shaders import shader_source

    device, ctx = tint_device
    kernel, edit, _ = V.VERSIONS[name]
    text = shader_source(kernel)
    edited = edit(text)
    assert edited != text
    full = kernel_source(ctx, kernel)
    assert text in full  # (the loader's directives, then the file)
    device.create_shader_module(code=full.replace(text, edited), label=f"{kernel}: {name}")


def test_an_edit_that_does_not_apply_stops_the_script():
    with pytest.raises(SystemExit, match="does not apply"):
        V.qhot("a kernel without the queries' loads")
