"""Array interop: DLPack and ``__array__`` inputs, read without copies where they already fit.

What reaches the backend is observed with a recording backend; "no copy" is asserted with
``np.shares_memory`` between the caller's memory and the arrays in the backend's Problem.
"""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn.backends.numpy_backend import NumpyBackend

NAMES = ("q", "k_cache", "v_cache", "block_tables", "selected", "cu_seqlens_q", "used_kv_lens")


class Recorder(NumpyBackend):
    """Numpy, keeping the last validated Problem it received."""

    name = "recorder"

    def forward_partials(self, problem, index):
        self.problem = problem
        return super().forward_partials(problem, index)


class DLPackOnly:
    """Exposes an array through DLPack only (no __array__, no buffer protocol)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class ArrayOnly:
    """Exposes an array through __array__ only."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        if dtype is not None and np.dtype(dtype) != self._a.dtype:
            return self._a.astype(dtype)
        return self._a


class DeviceLike(ArrayOnly):
    """A DLPack export that fails (as for a tensor on a GPU), with a working __array__."""

    def __dlpack__(self, *args, **kwargs):
        raise BufferError("this array lives on a device")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


def problem(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    arrays = dict(
        q=rng.standard_normal((7, 4, 16)).astype(dtype),
        k_cache=rng.standard_normal((9, 2, 4, 16)).astype(dtype),
        v_cache=rng.standard_normal((9, 2, 4, 16)).astype(dtype),
        block_tables=np.array([[3, -1, 8, 0, 5, 1], [2, 7, 4, 6, -1, -1]], dtype=np.int32),
        selected=np.array([[[0, 2], [1, -1]], [[2, 1], [0, 1]], [[1, -1], [-1, -1]], [[0, 1], [2, 0]],
                           [[1, 0], [0, -1]], [[0, -1], [1, 0]], [[1, 0], [-1, 0]]], dtype=np.int32),
        cu_seqlens_q=np.array([0, 3, 7], dtype=np.int32),
        used_kv_lens=np.array([22, 15], dtype=np.int32),
    )
    return arrays, dict(block_size=8, causal=True)


def run(arrays, kw, wrap=lambda a: a):
    be = Recorder()
    out, lse = psa.forward(**{k: wrap(v) for k, v in arrays.items()}, **kw, backend=be, return_lse=True)
    return be.problem, out, lse


def assert_matches_reference(arrays, kw, out, lse):
    ref_out, ref_lse = psa.dense_reference(**arrays, **kw)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wrap", [DLPackOnly, ArrayOnly], ids=["dlpack", "array"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_protocol_inputs_are_not_copied_R7(wrap, dtype):
    arrays, kw = problem(dtype)
    prob, out, lse = run(arrays, kw, wrap)
    for name in NAMES:
        got = getattr(prob, name)
        assert isinstance(got, np.ndarray), name
        if name == "q" and arrays[name].dtype != np.float32:  # widened exactly to float32 (R7)
            assert got.dtype == np.float32 and np.array_equal(got, arrays[name].astype(np.float32))
            continue
        assert np.shares_memory(got, arrays[name]), f"{name} was copied"
    _, plain_out, plain_lse = run(arrays, kw)
    np.testing.assert_array_equal(out, plain_out)  # same bits as with numpy inputs (R19)
    np.testing.assert_array_equal(lse, plain_lse)
    assert_matches_reference(arrays, kw, out, lse)


def test_int64_index_arrays_are_converted_to_int32_R7():
    arrays, kw = problem()
    wide = {k: (v.astype(np.int64) if v.dtype == np.int32 else v) for k, v in arrays.items()}
    prob, out, lse = run(wide, kw, DLPackOnly)
    for name in ("block_tables", "selected", "cu_seqlens_q", "used_kv_lens"):
        got = getattr(prob, name)
        assert got.dtype == np.int32 and got.flags.c_contiguous
        assert not np.shares_memory(got, wide[name])  # the documented copy
        np.testing.assert_array_equal(got, arrays[name])
    for name in ("q", "k_cache", "v_cache"):
        assert np.shares_memory(getattr(prob, name), wide[name])
    _, plain_out, _ = run(arrays, kw)
    np.testing.assert_array_equal(out, plain_out)


@pytest.mark.parametrize("wrap", [lambda a: a, DLPackOnly, ArrayOnly], ids=["numpy", "dlpack", "array"])
def test_non_contiguous_floats_are_copied_to_contiguous(wrap):
    arrays, kw = problem()
    # same values, other memory layouts: a transposed copy viewed back, and a strided slice
    q_t = np.ascontiguousarray(arrays["q"].transpose(2, 0, 1)).transpose(1, 2, 0)
    k_big = np.zeros((9, 2, 4, 32), np.float32)
    k_big[..., ::2] = arrays["k_cache"]
    k_strided = k_big[..., ::2]
    assert not q_t.flags.c_contiguous and not k_strided.flags.c_contiguous
    prob, out, lse = run({**arrays, "q": q_t, "k_cache": k_strided}, kw, wrap)
    assert prob.q.flags.c_contiguous and prob.k_cache.flags.c_contiguous
    assert not np.shares_memory(prob.q, q_t) and not np.shares_memory(prob.k_cache, k_big)
    assert np.shares_memory(prob.v_cache, arrays["v_cache"])
    _, plain_out, plain_lse = run(arrays, kw)
    np.testing.assert_array_equal(out, plain_out)
    np.testing.assert_array_equal(lse, plain_lse)


def test_failed_dlpack_export_falls_back_to_array():
    arrays, kw = problem()
    prob, out, lse = run(arrays, kw, DeviceLike)
    assert np.shares_memory(prob.k_cache, arrays["k_cache"])
    assert_matches_reference(arrays, kw, out, lse)


def test_other_float_dtypes_are_refused_not_converted_R7():
    arrays, kw = problem()
    for wrap in (DLPackOnly, ArrayOnly):
        with pytest.raises(psa.SpecError, match=r"q must have dtype.*float64.*\[R7\]") as info:
            psa.forward(**{**arrays, "q": wrap(arrays["q"].astype(np.float64))}, **kw)
        assert info.value.rule == "R7"


@pytest.mark.parametrize("bad", [3.0, None, object()], ids=["scalar", "none", "object"])
def test_non_arrays_are_refused_R7(bad):
    arrays, kw = problem()
    with pytest.raises(psa.SpecError, match=r"q must be an array.*\[R7\]"):
        psa.forward(**{**arrays, "q": bad}, **kw)


def test_python_lists_float_refused_int_converted_R7():
    arrays, kw = problem()
    # float lists become float64, which q/k/v refuse rather than convert
    with pytest.raises(psa.SpecError, match=r"q must have dtype.*float64.*\[R7\]"):
        psa.forward(**{**arrays, "q": arrays["q"].tolist()}, **kw)
    # integer lists are index arrays like any other (int64 -> int32 after the range check)
    prob, out, _ = run({**arrays, "selected": arrays["selected"].tolist(),
                        "cu_seqlens_q": arrays["cu_seqlens_q"].tolist()}, kw)
    assert prob.selected.dtype == np.int32
    np.testing.assert_array_equal(out, run(arrays, kw)[1])


def test_other_entry_points_accept_protocol_inputs():
    arrays, kw = problem()
    index = psa.build_kvouter_index(DLPackOnly(arrays["selected"]), ArrayOnly(arrays["block_tables"]),
                                    DLPackOnly(arrays["cu_seqlens_q"]), ArrayOnly(arrays["used_kv_lens"]),
                                    block_size=8, page_size=4, causal=True)
    ref = psa.build_kvouter_index(arrays["selected"], arrays["block_tables"], arrays["cu_seqlens_q"],
                                  arrays["used_kv_lens"], block_size=8, page_size=4, causal=True)
    np.testing.assert_array_equal(index.edge_query, ref.edge_query)
    np.testing.assert_array_equal(index.edge_len, ref.edge_len)
    parts = psa.forward_partials(DLPackOnly(arrays["q"]), ArrayOnly(arrays["k_cache"]),
                                 DLPackOnly(arrays["v_cache"]), index)
    out, lse = psa.combine_partials(parts, index)
    assert_matches_reference(arrays, kw, out, lse)
    o, l = psa.merge_states(DLPackOnly(out), ArrayOnly(lse), out, np.full_like(lse, -np.inf))
    np.testing.assert_allclose(o, out, atol=1e-6)  # (0, -inf) is the identity (R16)


def test_torch_cpu_tensors_are_read_in_place():
    torch = pytest.importorskip("torch")
    arrays, kw = problem()
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    prob, out, lse = run(tensors, kw)
    for name in NAMES:
        assert np.shares_memory(getattr(prob, name), arrays[name]), f"{name} was copied"
    assert_matches_reference(arrays, kw, out, lse)
    with pytest.raises(psa.SpecError, match=r"\[R7\]"):
        psa.forward(**{**tensors, "q": tensors["q"].double()}, **kw)
