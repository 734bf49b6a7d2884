"""The Dawn runtime's data: feature names, toggles and devices, checked on Dawn's Null adapter.

Dawn's Null adapter opens devices and validates everything without a GPU, so what the ``dawn``
backend asks of Dawn is checked wherever ``wgpudawn`` is installed (CI included, which must run
these: ``CI`` set and ``wgpudawn`` missing is a failure, not a skip).
"""

import pytest

from paged_sparse_attn.backends.wgpu._runtime import DAWN, SUBGROUP, SUBGROUP_MATRIX, WGPU_NATIVE


@pytest.fixture
def null_adapter(dawn_runtime):
    """A fresh Null adapter (an adapter opens one device only)."""
    return dawn_runtime.null_adapter()


def _toggles(device):
    from wgpudawn.backends.dawn import extras

    return set(extras.get_toggles(device))


def test_instance_toggles_reach_the_device(null_adapter):
    dev = DAWN.request_device(null_adapter, [], {})
    got = _toggles(dev)
    assert set(DAWN.instance_toggles) <= got  # subgroup matrices and f16 on NVIDIA unlocked
    assert not set(DAWN.device_toggles) & got  # timestamp quantization off
    assert "disable_robustness" not in got  # (asked for by DawnBackend, not by the runtime)
    dev.destroy()


def test_robustness_off_only_when_asked(null_adapter):
    dev = DAWN.request_device(null_adapter, [], {}, enable_toggles=("disable_robustness",))
    assert "disable_robustness" in _toggles(dev)
    dev.destroy()


def test_features_requested_in_dawn_spelling_and_reported_in_ours(null_adapter):
    offered = set(map(str, null_adapter.features))
    wanted = [f for f in DAWN.wanted_features() if f in offered]
    assert DAWN.subgroup_feature in wanted and DAWN.sgmat_feature in wanted  # the Null adapter has both
    dev = DAWN.request_device(null_adapter, wanted, {})
    feats = DAWN.logical_features(dev.features)
    assert {SUBGROUP, SUBGROUP_MATRIX, "shader-f16"} <= feats
    assert DAWN.subgroup_feature not in feats and DAWN.sgmat_feature not in feats
    dev.destroy()


def test_feature_names_map_both_ways():
    # disable_features accepts the host's names and either runtime's spelling
    assert DAWN.runtime_feature("subgroup") == "subgroups"
    assert DAWN.runtime_feature("subgroups") == "subgroups"
    assert DAWN.runtime_feature("subgroup-matrix") == "chromium-experimental-subgroup-matrix"
    assert WGPU_NATIVE.runtime_feature("subgroups") == "subgroup"
    assert WGPU_NATIVE.runtime_feature("shader_f16") == "shader-f16"
    assert WGPU_NATIVE.sgmat_feature is None and WGPU_NATIVE.runtime_feature("subgroup-matrix") == "subgroup-matrix"


def test_no_subgroup_matrix_configurations_without_the_feature(null_adapter):
    # the Null adapter offers the feature but no configuration: nothing may be assumed
    assert DAWN.subgroup_matrix_configs(null_adapter) == frozenset()
    assert WGPU_NATIVE.subgroup_matrix_configs(null_adapter) == frozenset()


def test_backend_says_whether_its_bounds_checks_are_on(monkeypatch):
    """``DawnBackend.robustness`` follows the option, maps to the device toggle and is what the
    bench reads to add its checked GEMM ceiling. By default the checks are off exactly while every
    kernel of the table is trusted and ``runtime_checks`` is not asked for (the shared
    constructor, which probes for a GPU, is left out: no adapter is needed for this)."""
    from paged_sparse_attn.backends.wgpu import _kernels
    from paged_sparse_attn.backends.wgpu.backend import DawnBackend, WgpuBackend

    monkeypatch.setattr(WgpuBackend, "__init__", lambda self, **options: None)
    assert _kernels.all_trusted()
    default, on, off = DawnBackend(), DawnBackend(robustness=True), DawnBackend(robustness=False)
    assert default.robustness is False and default._device_toggles == ("disable_robustness",)
    assert on.robustness is True and on._device_toggles == ()
    assert off.robustness is False and off._device_toggles == ("disable_robustness",)
    assert DawnBackend(runtime_checks=True).robustness is True
    # one kernel that is not trusted keeps the whole device checked
    table = dict(_kernels.KERNEL_TABLE)
    table["psa_invert.wgsl"] = _kernels.Kernel(table["psa_invert.wgsl"].bindings)
    monkeypatch.setattr(_kernels, "KERNEL_TABLE", table)
    assert not _kernels.all_trusted()
    assert DawnBackend().robustness is True and DawnBackend()._device_toggles == ()


def test_buffers_of_host_memory_are_requested_on_dawn_only(null_adapter):
    """Dawn's ``host-mapped-pointer`` (plans' pinned inputs and results) is asked for where the
    adapter offers it and reported under its own name; wgpu-native has no such feature and no
    non-blocking wait (its calls block on a map)."""
    assert DAWN.host_memory_feature in DAWN.wanted_features()
    assert WGPU_NATIVE.host_memory_feature is None and WGPU_NATIVE.poll_work_done is None
    assert DAWN.poll_work_done is not None
    assert DAWN.host_memory_feature in set(map(str, null_adapter.features))
    dev = DAWN.request_device(null_adapter, [DAWN.host_memory_feature], {})
    assert DAWN.host_memory_feature in DAWN.logical_features(dev.features)
    assert callable(DAWN.host_memory_module().create_buffer_from_host_memory)
    dev.destroy()


def test_the_polled_wait_returns_after_the_work_and_can_be_reused(null_adapter):
    """``DAWN.poll_work_done`` (one callback registration per thread, reused by every wait):
    each wait returns once the queue's work is done, polled (spin) or blocking (no spin), many
    times in a row; a wait on a lost device raises instead of returning as if the work were done."""
    from paged_sparse_attn.backends.wgpu import _runtime

    dev = DAWN.request_device(null_adapter, [], {})
    buf = dev.create_buffer(size=16, usage=0x0004 | 0x0008)  # COPY_SRC | COPY_DST
    for spin in (0.0, 0.002, 0.002, 0.0):
        enc = dev.create_command_encoder()
        enc.clear_buffer(buf, 0, 16)
        dev.queue.submit([enc.finish()])
        DAWN.poll_work_done(dev, spin)
        assert _runtime._work_done.w.status == _runtime._work_done.w.ok
    waiter = _runtime._work_done.w
    for _ in range(50):
        DAWN.poll_work_done(dev, 0.001)
    assert _runtime._work_done.w is waiter  # (made once per thread)
    dev.destroy()
    with pytest.raises(Exception, match="lost|status"):
        DAWN.poll_work_done(dev, 0.0)
