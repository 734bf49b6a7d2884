"""The trust boundary on the way back: what a backend returns is checked before the API uses it.

Each test wraps the numpy backend and breaks one thing it hands back; the public function must
raise DeviceError naming the backend and the rule, and never use (or return) the broken value.
"""

from __future__ import annotations

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn import index_branch as ib
from paged_sparse_attn.backends.numpy_backend import NumpyBackend


def small(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, 4, 8)).astype(np.float32)
    k = rng.standard_normal((6, 2, 2, 8)).astype(np.float32)
    v = rng.standard_normal((6, 2, 2, 8)).astype(np.float32)
    iq = rng.standard_normal((4, 2, 4)).astype(np.float32)
    ik = rng.standard_normal((6, 1, 2, 4)).astype(np.float32)
    bt = np.array([[0, 1, 2, 3, 4, 5], [5, 4, 3, -1, 1, 0]], np.int32)
    cu = np.array([0, 3, 4], np.int32)
    sel = np.array([[[0, 1], [2, -1]]] * 4, np.int32)
    return dict(q=q, k=k, v=v, iq=iq, ik=ik, bt=bt, cu=cu, sel=sel, block_size=4)


class Broken(NumpyBackend):
    """Numpy with one of its results replaced by ``self.patch(kind, value)``."""

    name = "broken-out"

    def __init__(self, kind, patch):
        self.kind, self.patch = kind, patch
        self.forward_calls = 0

    def select_topk(self, problem):
        sel = super().select_topk(problem)
        return self.patch(sel) if self.kind == "selection" else sel

    def block_scores(self, problem):
        s = super().block_scores(problem)
        return self.patch(s) if self.kind == "scores" else s

    def forward_partials(self, problem, index):
        p = super().forward_partials(problem, index)
        return self.patch(p) if self.kind == "partials" else p

    def forward(self, problem, index):
        self.forward_calls += 1
        res = super().forward(problem, index)
        return self.patch(res) if self.kind == "forward" else res


def _repeat_first(sel):
    sel = sel.copy()
    sel[0, 0, 1] = sel[0, 0, 0]  # a row repeats its local block: counted twice if used
    return sel


def _sparse(be, c):
    return ib.sparse_attention(c["q"], c["k"], c["v"], c["iq"], c["ik"], c["bt"], c["cu"],
                               block_size=c["block_size"], topk=2, backend=be)


def test_R6_sparse_attention_refuses_a_selection_with_a_repeated_block_id():
    c = small()
    be = Broken("selection", _repeat_first)
    with pytest.raises(psa.DeviceError, match=r"^sparse_attention\(\): backend 'broken-out' .*repeats block id "
                                              r".*\(a backend bug\) \[R6\]$"):
        _sparse(be, c)
    assert be.forward_calls == 0  # the selection never reached the forward
    # the same selection handed to forward() by a caller is a SpecError of R6: the two agree
    sel = _repeat_first(ib.select_topk(ib.block_scores(c["iq"], c["ik"], c["bt"], c["cu"], block_size=4), 2,
                                       cu_seqlens_q=c["cu"], block_size=4))
    with pytest.raises(psa.SpecError, match=r"\[R6\]$"):
        psa.forward(c["q"], c["k"], c["v"], c["bt"], sel, c["cu"], block_size=4)


@pytest.mark.parametrize("patch, what", [
    (lambda s: np.where(s == s.max(), 99, s).astype(np.int32), r"block id 99 .*\[R6\]$"),
    (lambda s: np.where(s == -1, -2, s).astype(np.int32), r"block id -2 .*\[R6\]$"),
    (lambda s: s.astype(np.int64), r"int64 .*expected int32 .*\[R24\]$"),
    (lambda s: s[:, :, :1].copy(), r"expected int32 \(4, 2, 3\).*\[R24\]$"),
    (lambda s: s.tolist(), r"as list, expected int32.*\[R24\]$"),
], ids=["id>=msb", "id<-1", "int64", "shape", "list"])
def test_R24_select_topk_checks_what_the_backend_returns(patch, what):
    c = small()
    scores = ib.block_scores(c["iq"], c["ik"], c["bt"], c["cu"], block_size=4)
    scores[0, 0, 0] = -np.inf  # a -1 padding slot exists in row (0, 0)
    with pytest.raises(psa.DeviceError, match=what):
        ib.select_topk(scores, 3, force_local=False, backend=Broken("selection", patch))


@pytest.mark.parametrize("patch", [lambda s: s.astype(np.float64), lambda s: s[..., :-1].copy()],
                         ids=["float64", "shape"])
def test_R22_block_scores_checks_what_the_backend_returns(patch):
    c = small()
    be = Broken("scores", patch)
    with pytest.raises(psa.DeviceError, match=r"^block_scores\(\): backend 'broken-out' returned block scores .*\[R22\]$"):
        ib.block_scores(c["iq"], c["ik"], c["bt"], c["cu"], block_size=4, backend=be)
    with pytest.raises(psa.DeviceError, match=r"^sparse_attention\(\): .*\[R22\]$"):
        _sparse(be, c)
    assert be.forward_calls == 0


@pytest.mark.parametrize("patch, what", [
    (lambda r: (r[0].astype(np.float64), r[1]), "out as float64"),
    (lambda r: (r[0], r[1][:, :1].copy()), "lse as float32 (4, 1)"),
    (lambda r: [r[0], r[1]], "returned list, expected a tuple"),
], ids=["out-float64", "lse-shape", "list"])
def test_R11_forward_checks_out_and_lse(patch, what):
    c = small()
    be = Broken("forward", patch)
    with pytest.raises(psa.DeviceError, match=r"^forward\(\): backend 'broken-out' .*\[R11\]$") as info:
        psa.forward(c["q"], c["k"], c["v"], c["bt"], c["sel"], c["cu"], block_size=4, backend=be)
    assert what in str(info.value)
    with pytest.raises(psa.DeviceError, match=r"^sparse_attention\(\): .*\[R11\]$"):
        _sparse(be, c)


def test_R14_forward_partials_checks_the_partials():
    c = small()
    index = psa.build_kvouter_index(c["sel"], c["bt"], c["cu"], block_size=4, page_size=2)
    bad = Broken("partials", lambda p: psa.Partials(p.o[:, :1].copy(), p.m, p.l))
    with pytest.raises(psa.DeviceError, match=r"^forward_partials\(\): backend 'broken-out' returned partials.o "
                                              r".*\[R14\]$"):
        psa.forward_partials(c["q"], c["k"], c["v"], index, backend=bad)
    bad = Broken("partials", lambda p: (p.o, p.m, p.l))
    with pytest.raises(psa.DeviceError, match=r"returned tuple, expected Partials .*\[R14\]$"):
        psa.forward_partials(c["q"], c["k"], c["v"], index, backend=bad)


def test_R14_the_default_forward_checks_the_partials_before_its_combine():
    class Partial(psa.Backend):
        name = "bad-partials"

        @property
        def capabilities(self):
            return psa.Capabilities()

        def forward_partials(self, problem, index):
            E, G, D = index.num_edges, problem.group_size, problem.head_dim
            return psa.Partials(np.zeros((E, G, D), np.float64), np.zeros((E, G), np.float32),
                                np.ones((E, G), np.float32))

    c = small()
    with pytest.raises(psa.DeviceError, match=r"^forward\(\): backend 'bad-partials' returned partials.o as "
                                              r"float64 .*\[R14\]$"):
        psa.forward(c["q"], c["k"], c["v"], c["bt"], c["sel"], c["cu"], block_size=4, backend=Partial())


class FakeDeviceArray(psa.DeviceArray):
    """Shape and dtype only: values live elsewhere and are not read by the checks."""

    def __init__(self, shape, dtype, backend=None):
        self.shape, self.dtype, self.backend = tuple(shape), np.dtype(dtype), backend

    def __array__(self, *args, **kwargs):  # pragma: no cover - reading it is the failure
        raise AssertionError("the output checks read the values of a device array")


def test_device_array_outputs_are_checked_for_shape_and_dtype_only():
    from paged_sparse_attn._outputs import checked_out_lse, checked_selection

    be = NumpyBackend()
    sel = FakeDeviceArray((4, 2, 3), np.int32)
    assert checked_selection(be, "f", sel, (4, 2, 3), msb=2) is sel  # values are the backend's to check
    with pytest.raises(psa.DeviceError, match=r"int32 \(4, 2, 2\)"):
        checked_selection(be, "f", sel, (4, 2, 2), msb=2)
    out, lse = FakeDeviceArray((4, 4, 8), np.float32), FakeDeviceArray((4, 4), np.float32)
    assert checked_out_lse(be, "f", (out, lse), (4, 4, 8)) == (out, lse)
    with pytest.raises(psa.DeviceError, match="lse as float16"):
        checked_out_lse(be, "f", (out, FakeDeviceArray((4, 4), np.float16)), (4, 4, 8))


class NoIndexBranch(NumpyBackend):
    """Numpy's code, but its capabilities do not declare the index branch."""

    name = "no-index-branch"
    calls = 0

    @property
    def capabilities(self):
        return psa.Capabilities()

    def block_scores(self, problem):  # pragma: no cover - reaching it is the failure
        type(self).calls += 1
        return super().block_scores(problem)

    select_topk = block_scores


def test_R18_the_index_branch_runs_only_on_a_backend_that_declares_it():
    c = small()
    be = NoIndexBranch()
    msg = r"backend 'no-index-branch' does not implement the index branch .*index_branch=False \[R18\]$"
    with pytest.raises(psa.UnsupportedError, match=r"^block_scores\(\): " + msg):
        ib.block_scores(c["iq"], c["ik"], c["bt"], c["cu"], block_size=4, backend=be)
    with pytest.raises(psa.UnsupportedError, match=r"^select_topk\(\): " + msg):
        ib.select_topk(np.zeros((4, 2, 3), np.float32), 1, force_local=False, backend=be)
    with pytest.raises(psa.UnsupportedError, match=r"^sparse_attention\(\): " + msg):
        _sparse(be, c)
    assert NoIndexBranch.calls == 0
    assert psa.get_backend("numpy").capabilities.index_branch
