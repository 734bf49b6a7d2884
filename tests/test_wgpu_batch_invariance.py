"""R27 on the wgpu backend: with ``batch_invariant=True`` the kit's batch-invariance property
holds (a sequence's rows alone, in its batch and in a shuffled, enlarged batch: same bits)."""

from __future__ import annotations

import pytest

from paged_sparse_attn.testing import test_conformance as kit


@pytest.fixture(scope="module")
def invariant(WgpuBackend):
    be = WgpuBackend(batch_invariant=True)
    yield be
    be.close()


def test_R27_wgpu_batch_invariant_option_is_declared_and_holds(invariant, WgpuBackend):
    assert invariant.capabilities.batch_invariant
    assert not WgpuBackend().capabilities.batch_invariant  # off by default (it costs decode speed)
    kit.test_R27_rows_do_not_depend_on_the_rest_of_the_batch(backend=invariant)


def test_R27_wgpu_batch_invariant_cannot_take_the_decode_kernel(WgpuBackend):
    with pytest.raises(ValueError, match="batch_invariant"):
        WgpuBackend(batch_invariant=True, partials_kernel="decode")
