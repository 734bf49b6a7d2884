"""Reliability on every backend: bad input never reaches a backend or the device (R17), a
hand-made or modified KVOuterIndex is refused (R13, R10), NaN in attended data reaches only
the rows that attend it, and float16 data whose products overflow float16 stay exact (R12).

"Before any device work" is proven with a spy: inside :func:`no_device_work` every compute
method of the backend and every wgpu call that allocates, writes, encodes or submits fails the
test if it is reached (and records itself, in case the code under test swallowed the error).

The wgpu-only parts (oversize problems, device errors, threads, the soak) are in
``test_reliability_wgpu.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import dataclasses
import sys
import warnings
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_sparse_attn as psa
from paged_sparse_attn._validation import FLOAT_DTYPES
from paged_sparse_attn.index_branch import block_scores_reference
from paged_sparse_attn.testing import strategies as pst
from paged_sparse_attn.testing.assertions import assert_attention_close, tolerance
from paged_sparse_attn.testing.problem import FORWARD_ARGS, AttentionProblem, to_layout

from paged_sparse_attn.testing.generate import random_problem
from paged_sparse_attn.testing.oracle import attended_mask

# --- the spy -------------------------------------------------------------------------------------

BACKEND_WORK = ("forward", "forward_partials", "combine_partials", "block_scores", "select_topk",
                "upload_kv_cache", "update_pages")
WGPU_WORK = {
    "GPUDevice": ("create_buffer", "create_buffer_with_data", "create_command_encoder",
                  "create_compute_pipeline", "create_shader_module", "create_bind_group"),
    "GPUQueue": ("submit", "write_buffer", "read_buffer"),
}


@contextlib.contextmanager
def no_device_work(*backends, methods: tuple[str, ...] = BACKEND_WORK):
    """Trap backend compute methods and wgpu allocation / submission inside the block.

    Yields the list of what was reached; the caller asserts it is empty after the block (the
    trap raises AssertionError too, but code under test might swallow it).
    """
    hits: list[str] = []

    def trap(what: str) -> Callable:
        def call(*args: Any, **kwargs: Any):
            hits.append(what)
            raise AssertionError(f"{what} was reached although the input is invalid: validation must "
                                 "refuse it before any backend or device work (R17)")
        return call

    undo: list[Callable[[], None]] = []
    for be in backends:
        for name in methods:
            if hasattr(be, name):
                setattr(be, name, trap(f"{be.name}.{name}()"))
                undo.append(lambda be=be, name=name: delattr(be, name))
    # the runtimes' classes exist only once something imported them (wgpu-native, Dawn)
    for mod_name, impl_name in (("wgpu", "wgpu.backends.wgpu_native"), ("wgpudawn", "wgpudawn.backends.dawn")):
        if mod_name not in sys.modules:
            continue
        mod, impl = importlib.import_module(mod_name), importlib.import_module(impl_name)
        for cls_name, names in WGPU_WORK.items():
            for cls in {getattr(mod, cls_name), getattr(impl, cls_name)}:
                for name in names:
                    if name in cls.__dict__:
                        old = cls.__dict__[name]
                        setattr(cls, name, trap(f"wgpu {cls_name}.{name}()"))
                        undo.append(lambda cls=cls, name=name, old=old: setattr(cls, name, old))
    try:
        yield hits
    finally:
        for u in reversed(undo):
            u()


def test_the_spy_catches_backend_and_device_work(backend):
    """The spy itself: a valid call inside it is caught (else the R17 tests prove nothing)."""
    pb = random_problem(1, seqlens_q=(2,))
    with no_device_work(backend) as hits, pytest.raises(AssertionError, match="R17"):
        psa.forward(*pb.args, **pb.options, backend=backend)
    assert hits and hits[0] == f"{backend.name}.forward()"
    if backend.capabilities.device_arrays:  # a GPU backend: its device calls are trapped too
        with no_device_work(methods=()) as hits, pytest.raises(AssertionError, match="R17"):
            psa.forward(*pb.args, **pb.options, backend=backend)
        assert hits and hits[0].startswith("wgpu ")
    out = psa.forward(*pb.args, **pb.options, backend=backend)  # everything restored
    assert out.shape == pb.q.shape


# --- corrupting one field of a valid problem ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """A forward call made from ``base`` by changing some fields.

    ``rule`` is the rule the call violates, or None when the change keeps the problem valid
    (then every function must compute the same result as the reference on the changed inputs).
    """

    base: AttentionProblem
    kwargs: dict
    changed: frozenset
    rule: str | None
    what: str

    def __repr__(self) -> str:
        return f"Case(rule={self.rule!r}, what={self.what!r}, changed={sorted(self.changed)}, base={self.base!r})"


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.array(a)
    a.flags.writeable = False
    return a


def _strided(a: np.ndarray) -> np.ndarray:
    """The same values as a non-contiguous view (every other element of a bigger array)."""
    a = np.asarray(a)
    big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype) if a.ndim else a
    big[..., ::2] = a
    v = big[..., ::2]
    assert v.size < 2 or not v.flags.c_contiguous
    return v


def _caches(p: AttentionProblem) -> tuple[np.ndarray, np.ndarray]:
    """The problem's caches as its calls pass them: in its kv_layout (R34)."""
    return to_layout(p.k_cache, p.kv_layout), to_layout(p.v_cache, p.kv_layout)


def _layout_of(kw: dict) -> str | None:
    """The call's kv_layout if it is a valid one (a case may corrupt it, R34)."""
    x = kw.get("kv_layout", "HND")
    return x if isinstance(x, str) and x in pst.KV_LAYOUTS else None


def _index_arrays(p: AttentionProblem) -> dict:
    return {"block_tables": p.block_tables, "selected": p.selected, "cu_seqlens_q": p.cu_seqlens_q,
            "used_kv_lens": p.kv_lens.astype(np.int32)}


# Valid variants: the problem stays valid (R1-R8), sometimes with zero-size dimensions.
def _v_non_contiguous(p, pick):
    names = ["q", "k_cache", "v_cache", "block_tables", "selected", "cu_seqlens_q", "used_kv_lens"]
    k, v = _caches(p)
    arrs = {"q": p.q, "k_cache": k, "v_cache": v, **_index_arrays(p)}
    return {n: _strided(arrs[n]) for n in names}, "every array is a non-contiguous view"


def _v_fortran(p, pick):
    k, v = _caches(p)
    return {"k_cache": np.asfortranarray(k), "v_cache": np.asfortranarray(v),
            "selected": np.asfortranarray(p.selected)}, "caches and selected in Fortran order"


def _v_read_only(p, pick):
    k, v = _caches(p)
    arrs = {"q": p.q, "k_cache": k, "v_cache": v, **_index_arrays(p)}
    return {n: _ro(a) for n, a in arrs.items()}, "every array is read-only"


def _v_int_dtypes(p, pick):
    dt = [np.int16, np.int64, np.intp][pick(0, 2)]
    return {n: np.asarray(a).astype(dt) for n, a in _index_arrays(p).items()}, f"index arrays are {np.dtype(dt).name}"


def _v_lists(p, pick):
    if any(np.asarray(a).size == 0 for a in _index_arrays(p).values()):
        return None  # an empty nested list loses its shape and integer dtype
    return {n: np.asarray(a).tolist() for n, a in _index_arrays(p).items()}, "index arrays are Python lists"


def _v_scalar_types(p, pick):
    scale = [np.float16(0.5), np.float64(0.25), 2, np.int32(-1)][pick(0, 3)]
    return {"block_size": np.int64(p.block_size), "softmax_scale": scale, "causal": np.bool_(p.causal)}, \
        f"numpy scalars: softmax_scale={scale!r}"


def _v_topk_zero(p, pick):
    return {"selected": np.zeros((p.num_queries, p.num_kv_heads, 0), np.int32)}, "topk = 0"


def _v_no_queries(p, pick):
    return {"q": p.q[:0], "selected": p.selected[:0],
            "cu_seqlens_q": np.zeros(p.num_seqs + 1, np.int32)}, "Tq = 0 (every sequence empty)"


def _v_no_sequences(p, pick):
    return {"q": p.q[:0], "selected": p.selected[:0], "cu_seqlens_q": np.zeros(1, np.int32),
            "block_tables": p.block_tables[:0], "used_kv_lens": np.zeros(0, np.int32)}, "B = 0"


def _v_no_pages(p, pick):
    shape = (0,) + _caches(p)[0].shape[1:]
    return {"k_cache": np.zeros(shape, p.k_cache.dtype), "v_cache": np.zeros(shape, p.v_cache.dtype),
            "block_tables": np.full_like(p.block_tables, -1)}, "P = 0, every page unmapped"


def _v_nan_in_q(p, pick):
    if p.num_queries == 0:
        return None
    q = np.array(p.q)
    q[pick(0, p.num_queries - 1), pick(0, p.num_q_heads - 1), pick(0, p.head_dim - 1)] = np.nan
    return {"q": q}, "one NaN in q (valid data: only its row may be NaN)"


VALID = (_v_non_contiguous, _v_fortran, _v_read_only, _v_int_dtypes, _v_lists, _v_scalar_types, _v_topk_zero,
         _v_no_queries, _v_no_sequences, _v_no_pages, _v_nan_in_q)


# Violations the strategies' catalogue (pst.MUTATIONS) does not make; each with its rule.
def _x_none(p, pick):
    name = ["q", "k_cache", "block_tables", "selected", "cu_seqlens_q"][pick(0, 4)]
    rule = {"q": "R7", "k_cache": "R7", "block_tables": "R7", "selected": "R7", "cu_seqlens_q": "R7"}[name]
    return {name: None}, f"{name} is None", rule


def _x_object_dtype(p, pick):
    name = ["block_tables", "selected", "q"][pick(0, 2)]
    return {name: np.asarray(getattr(p, name)).astype(object)}, f"{name} has dtype object", "R7"


def _x_zero_d(p, pick):
    name, rule = [("block_tables", "R2"), ("selected", "R6"), ("cu_seqlens_q", "R3"), ("used_kv_lens", "R4"),
                  ("q", "R1")][pick(0, 4)]
    return {name: np.array(1, dtype=np.float32 if name == "q" else np.int32)}, f"{name} is 0-d", rule


def _x_huge_id(p, pick):
    if p.num_queries == 0 or p.topk == 0:
        return None
    sel = np.array(p.selected, dtype=np.int64)
    sel[pick(0, p.num_queries - 1), pick(0, p.num_kv_heads - 1), pick(0, p.topk - 1)] = 2**40 + pick(0, 3)
    return {"selected": sel}, "selected holds 2**40", "R7"


def _x_uint64_overflow(p, pick):
    return {"cu_seqlens_q": np.asarray(p.cu_seqlens_q).astype(np.uint64) + np.uint64(2**63)}, \
        "cu_seqlens_q as uint64 beyond int64", "R7"


def _x_zero_head_dim(p, pick):
    return {"q": np.zeros(p.q.shape[:2] + (0,), p.q.dtype),
            "k_cache": np.zeros(_caches(p)[0].shape[:3] + (0,), p.k_cache.dtype),
            "v_cache": np.zeros(_caches(p)[1].shape[:3] + (0,), p.v_cache.dtype)}, "head_dim 0", "R1"


def _x_zero_q_heads(p, pick):
    return {"q": np.zeros((p.num_queries, 0, p.head_dim), p.q.dtype)}, "Hq = 0", "R1"


def _x_bad_tail_page(p, pick):
    # a page past msb * ppb is never read (R5), but R2 still forbids any value < -1
    bt = np.concatenate([p.block_tables, np.full((p.num_seqs, 1), -7, np.int32)], axis=1)
    return {"block_tables": bt}, "block_tables has -7 in a column that is never read", "R2"


def _x_scale_types(p, pick):
    bad = [np.float32("nan"), np.float16("inf"), complex(1, 0), np.array(0.5), "nan"][pick(0, 4)]
    return {"softmax_scale": bad}, f"softmax_scale = {bad!r}", "R8"


EXTRA = (_x_none, _x_object_dtype, _x_zero_d, _x_huge_id, _x_uint64_overflow, _x_zero_head_dim, _x_zero_q_heads,
         _x_bad_tail_page, _x_scale_types)


@st.composite
def cases(draw, *, caps) -> Case:
    """A valid problem with one field corrupted (or changed in a valid way)."""
    base = draw(pst.problems(caps=caps, max_queries=6, default_lens=False), label="base")
    pick = lambda lo, hi: draw(st.integers(lo, hi))  # noqa: E731
    kind = draw(st.sampled_from(["catalogue", "extra", "valid"]), label="kind")
    if kind == "catalogue":
        pool = [(r, m) for r, ms in pst.MUTATIONS.items() for m in ms]
    else:
        pool = [(None, m) for m in (EXTRA if kind == "extra" else VALID)]
    for i in draw(st.permutations(range(len(pool)))):
        rule, mutate = pool[i]
        got = mutate(base, pick)
        if got is None:
            continue
        changes, what = got[0], got[1]
        if kind == "extra":
            rule = got[2]
        if kind == "catalogue" and "kv_layout" not in changes:  # the catalogue changes logical caches
            changes = {n: to_layout(a, base.kv_layout) if n in ("k_cache", "v_cache") else a
                       for n, a in changes.items()}
        kwargs = base.kwargs()
        if kwargs["used_kv_lens"] is None:
            kwargs["used_kv_lens"] = base.kv_lens.astype(np.int32)
        kwargs.update(changes)
        return Case(base, {n: kwargs[n] for n in FORWARD_ARGS}, frozenset(changes), rule, what)
    raise AssertionError("unreachable: some change applies to every problem")  # pragma: no cover


# --- calling every public function with a case ----------------------------------------------------

def _spec_error(call: Callable, fns: tuple[str, ...], rule: str | None, what: str) -> psa.SpecError:
    """``call()`` must raise a SpecError of ``rule`` (any rule if None) named after one of ``fns``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
    except psa.SpecError as err:
        msg = str(err)
        assert any(msg.startswith(f"{fn}(): ") for fn in fns), f"{what}: message must name {fns}: {msg}"
        assert msg.endswith(f"[{err.rule}]") and err.rule, f"{what}: message must end with the rule id: {msg}"
        if rule is not None:
            assert err.rule == rule, f"{what}: expected a SpecError for {rule}, got {err.rule}: {msg}"
        return err
    except Exception as exc:
        raise AssertionError(f"{what}: {fns[0]}() raised {type(exc).__name__} instead of SpecError: {exc}") from exc
    raise AssertionError(f"{what}: {fns[0]}() accepted an invalid input")


def _page_size(kw: dict, base: AttentionProblem) -> int:
    k = kw["k_cache"]
    ax = 1 if _layout_of(kw) == "NHD" else 2  # the page axis of the call's layout (R34)
    return int(k.shape[ax]) if isinstance(k, np.ndarray) and k.ndim == 4 and k.shape[ax] > 0 else base.page_size


def _pipeline(kw: dict, base: AttentionProblem, backend) -> tuple[np.ndarray, np.ndarray]:
    """build_kvouter_index -> forward_partials -> combine_partials: forward in three public steps."""
    ix = psa.build_kvouter_index(kw["selected"], kw["block_tables"], kw["cu_seqlens_q"], kw["used_kv_lens"],
                                 block_size=kw["block_size"], page_size=_page_size(kw, base), causal=kw["causal"])
    part = psa.forward_partials(kw["q"], kw["k_cache"], kw["v_cache"], ix, softmax_scale=kw["softmax_scale"],
                                kv_layout=kw["kv_layout"], backend=backend)
    return psa.combine_partials(part, ix)


_SPARSE_ATTENTION_OK = frozenset(FORWARD_ARGS) - {"selected"}
_BLOCK_SCORES_ARGS = frozenset({"k_cache", "block_tables", "cu_seqlens_q", "used_kv_lens", "block_size",
                                "softmax_scale", "causal", "kv_layout"})


def _index_inputs(kw: dict, base: AttentionProblem) -> tuple[np.ndarray, np.ndarray]:
    """index_q [Tq, Hkv, D] and index_k_cache [P, 1, S, D] ([P, S, 1, D] in NHD) paged like the
    caches: made from the case's q and k_cache when those are valid arrays, else from the base
    problem's (in the call's layout, or HND when the case corrupts kv_layout)."""
    q, k = kw["q"], kw["k_cache"]
    nhd = _layout_of(kw) == "NHD"
    ax = 2 if nhd else 1  # the KV-head axis (R34)
    ok = (isinstance(q, np.ndarray) and isinstance(k, np.ndarray) and q.ndim == 3 and k.ndim == 4
          and q.dtype in FLOAT_DTYPES and k.dtype in FLOAT_DTYPES and q.shape[1] >= k.shape[ax] >= 1
          and q.shape[1] % k.shape[ax] == 0)
    q, k = (q, k) if ok else (base.q, to_layout(base.k_cache, "NHD" if nhd else "HND"))
    G = q.shape[1] // k.shape[ax]
    return np.ascontiguousarray(q[:, ::G]), np.ascontiguousarray(k[:, :, :1] if nhd else k[:, :1])


def _sparse_attention(kw: dict, base: AttentionProblem, backend):
    iq, ik = _index_inputs(kw, base)
    return psa.sparse_attention(kw["q"], kw["k_cache"], kw["v_cache"], iq, ik, kw["block_tables"],
                                kw["cu_seqlens_q"], used_kv_lens=kw["used_kv_lens"], block_size=kw["block_size"],
                                topk=max(1, base.msb), causal=kw["causal"], softmax_scale=kw["softmax_scale"],
                                kv_layout=kw["kv_layout"], backend=backend, return_lse=True)


def _block_scores(kw: dict, base: AttentionProblem, backend):
    iq, _ = _index_inputs(kw, base)
    return psa.block_scores(iq, kw["k_cache"], kw["block_tables"], kw["cu_seqlens_q"], kw["used_kv_lens"],
                            block_size=kw["block_size"], softmax_scale=kw["softmax_scale"], causal=kw["causal"],
                            kv_layout=kw["kv_layout"], backend=backend)


def _select_topk(kw: dict, base: AttentionProblem, backend):
    scores = np.random.default_rng(0).standard_normal((base.num_queries, base.num_kv_heads, base.msb))
    return psa.select_topk(scores.astype(np.float32), max(1, base.msb), force_local=True,
                           cu_seqlens_q=kw["cu_seqlens_q"], used_kv_lens=kw["used_kv_lens"],
                           block_size=kw["block_size"], backend=backend)


def _resident(backend, kw: dict):
    """Device-resident copies of the case's caches, or None for a backend without device arrays."""
    if not backend.capabilities.device_arrays:
        return None
    k, v = kw["k_cache"], kw["v_cache"]
    layout = _layout_of(kw)
    if not (isinstance(k, np.ndarray) and isinstance(v, np.ndarray) and k.ndim == 4 and k.shape == v.shape
            and k.dtype == v.dtype and k.dtype.name in backend.capabilities.dtypes and k.shape[1] > 0
            and k.shape[2] > 0 and k.shape[3] > 0 and layout is not None):
        return None
    return backend.upload_kv_cache(k, v, kv_layout=layout)


def _check_invalid(backend, case: Case) -> None:
    kw, rule, what = case.kwargs, case.rule, case.what
    # the base problem's caches, device-resident, when the corruption is elsewhere
    resident = None if case.changed & {"k_cache", "v_cache"} else _resident(backend, case.base.kwargs())
    try:
        with no_device_work(backend) as hits:
            _spec_error(lambda: psa.forward(**kw, backend=backend), ("forward",), rule, what)
            _spec_error(lambda: psa.dense_reference(**kw), ("dense_reference",), rule, what)
            _spec_error(lambda: _pipeline(kw, case.base, backend),
                        ("build_kvouter_index", "forward_partials", "combine_partials"), None, what)
            if resident is not None:  # device-resident caches: the index arrays are still checked first
                _spec_error(lambda: psa.forward(**{**kw, "k_cache": resident[0], "v_cache": resident[1]},
                                                backend=backend), ("forward",), rule, what)
            if case.changed <= _SPARSE_ATTENTION_OK:
                _spec_error(lambda: _sparse_attention(kw, case.base, backend), ("sparse_attention",), None, what)
            if case.changed & _BLOCK_SCORES_ARGS and case.changed <= _BLOCK_SCORES_ARGS | {"v_cache"}:
                _spec_error(lambda: _block_scores(kw, case.base, backend), ("block_scores",), None, what)
        assert not hits, f"{what}: {hits[0]} was reached (R17)"
        if case.changed <= {"cu_seqlens_q", "used_kv_lens", "block_size"}:
            _check_select_topk(kw, case, backend)
    finally:
        for a in resident or ():
            a.release()


def _check_select_topk(kw: dict, case: Case, backend) -> None:
    """select_topk sees only some of the layout (no block table): what forward refuses may be
    valid for it. It must refuse cleanly before any device work, or return a valid selection."""
    sel = None
    with no_device_work(methods=()) as hits:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sel = _select_topk(kw, case.base, backend)
        except psa.SpecError as err:
            assert not hits, f"{case.what}: select_topk reached {hits[0]} before refusing the input (R17)"
            assert str(err).startswith("select_topk(): ") and str(err).endswith(f"[{err.rule}]"), str(err)
            return
        except AssertionError:
            if not hits:
                raise
    if hits:  # valid for select_topk: it went to the device; run it for real
        sel = _select_topk(kw, case.base, backend)
    sel = np.asarray(sel)
    msb = case.base.msb
    assert sel.dtype == np.int32 and sel.shape == (case.base.num_queries, case.base.num_kv_heads, max(1, msb))
    assert ((sel >= -1) & (sel < msb)).all(), f"{case.what}: select_topk returned ids outside [-1, {msb})"
    srt = np.sort(sel, axis=-1)
    assert not ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(), "select_topk repeated an id"


def _check_valid(backend, case: Case) -> None:
    kw, what = case.kwargs, case.what
    dtypes = (np.asarray(kw["q"]).dtype, np.asarray(kw["k_cache"]).dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NaN in q: numpy warns about the invalid value, rightly
        ref, ref_lse = psa.dense_reference(**kw)
        out, lse = psa.forward(**kw, backend=backend, return_lse=True)
        out2, lse2 = _pipeline(kw, case.base, backend)
    for got, got_lse, how in ((out, lse, "forward"), (out2, lse2, "pipeline")):
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(got), nan), f"{what}: {how} NaN where the reference has none, or not"
        assert np.array_equal(np.isnan(got_lse), np.isnan(ref_lse)), f"{what}: {how} lse NaN pattern"
        rows = ~nan.any(axis=-1)
        assert_attention_close(got, ref, dtype=dtypes, lse=got_lse, ref_lse=ref_lse, rows=rows,
                               err_msg=f"[{backend.name}] {what} ({how}):")
    resident = _resident(backend, kw)
    if resident is not None:
        try:
            out3 = psa.forward(**{**kw, "k_cache": resident[0], "v_cache": resident[1]}, backend=backend)
            np.testing.assert_array_equal(out3, out, err_msg=f"{what}: resident caches changed the result")
        finally:
            for a in resident:
                a.release()
    if case.changed <= _SPARSE_ATTENTION_OK:
        try:
            got = _sparse_attention(kw, case.base, backend)
        except psa.UnsupportedError as err:  # a backend without the index branch says so (R18)
            assert backend.name != "numpy" and backend.name in str(err), str(err)
        else:
            want = _sparse_attention(kw, case.base, "numpy")
            assert_attention_close(got[0], want[0], dtype=dtypes, lse=got[1], ref_lse=want[1],
                                   rows=~np.isnan(want[0]).any(axis=-1), err_msg=f"{what} (sparse_attention):")
    if case.changed & _BLOCK_SCORES_ARGS and case.changed <= _BLOCK_SCORES_ARGS | {"v_cache"}:
        iq, _ = _index_inputs(kw, case.base)
        want = block_scores_reference(iq, kw["k_cache"], kw["block_tables"], kw["cu_seqlens_q"], kw["used_kv_lens"],
                                      block_size=kw["block_size"], softmax_scale=kw["softmax_scale"],
                                      causal=kw["causal"], kv_layout=kw["kv_layout"])
        try:
            got = _block_scores(kw, case.base, backend)
        except psa.UnsupportedError as err:
            assert backend.name != "numpy" and backend.name in str(err), str(err)
        else:
            tol = tolerance(dtypes).out
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{what} (block_scores)")


@given(case=st.data())
def test_R17_one_corrupted_field_is_refused_by_every_public_function_before_device_work(backend, case):
    """forward, dense_reference, build_kvouter_index + forward_partials + combine_partials,
    sparse_attention, block_scores and select_topk, with host or device-resident caches: a
    violation gives a clean SpecError (never another exception) and no backend or device work;
    a valid change (views, read-only, other integer types, zero-size dimensions) gives the
    reference's result."""
    c = case.draw(cases(caps=backend.capabilities), label="case")
    if c.rule is None:
        _check_valid(backend, c)
    else:
        _check_invalid(backend, c)


# --- out-of-range ids never reach a kernel -----------------------------------------------------

def _poisoned():
    """A problem whose unattended cache cells all hold NaN/Inf (R10): any stray read shows."""
    return random_problem(5, seqlens_q=(2, 3, 1), Hkv=2, G=2, D=4, page_size=2, ppb=2, msb=3, used="random",
                        poison=True, causal=True)


def _index(pb, **over):
    kw = dict(block_size=pb.block_size, page_size=pb.page_size, causal=pb.causal)
    kw.update(over)
    return psa.build_kvouter_index(pb.selected, pb.block_tables, pb.cu_seqlens_q, pb.used_kv_lens, **kw)


@pytest.mark.parametrize("where", ["page >= P", "page < -1", "block >= msb", "block < -1"])
def test_R2_R6_out_of_range_ids_are_refused_before_dispatch(backend, where):
    pb = _poisoned()
    bt, sel = pb.block_tables.copy(), pb.selected.copy()
    P, msb = pb.k_cache.shape[0], bt.shape[1] // 2
    if where == "page >= P":
        bt[1, 0] = P
    elif where == "page < -1":
        bt[0, 1] = -2
    elif where == "block >= msb":
        sel[2, 1, 0] = msb
    else:
        sel[0, 0, 0] = -3
    rule = "R2" if "page" in where else "R6"
    resident = _resident(backend, {"k_cache": pb.k_cache, "v_cache": pb.v_cache})
    try:
        with no_device_work(backend) as hits:
            for k, v in [(pb.k_cache, pb.v_cache)] + ([resident] if resident else []):
                with pytest.raises(psa.SpecError, match=rf"\[{rule}\]$"):
                    psa.forward(pb.q, k, v, bt, sel, pb.cu_seqlens_q, **pb.options, backend=backend)
        assert not hits
    finally:
        for a in resident or ():
            a.release()


def test_R2_forward_partials_refuses_an_index_referencing_pages_beyond_the_cache(backend):
    """An index built for a bigger pool (pages >= P of these caches) never reaches a kernel."""
    pb = _poisoned()
    ix = _index(pb)
    P = int(pb.block_tables.max())  # a cache without the highest page the index references
    with no_device_work(backend) as hits, pytest.raises(
            psa.SpecError, match=rf"block_tables contains {P} at \[\d+, \d+\], expected -1 or a page id in \[0, {P}\) \[R2\]"):
        psa.forward_partials(pb.q, pb.k_cache[:P], pb.v_cache[:P], ix, backend=backend)
    assert not hits


def _shift(a: np.ndarray, j: int, d: int) -> np.ndarray:
    a = a.copy()
    a[j] += d
    return a


def _dup_first_edge(ix):
    """Edge 0 twice: a repeated (t, h, s), i.e. a block counted twice."""
    f = {n: np.concatenate([getattr(ix, n)[:1], getattr(ix, n)]) for n in
         ("edge_query", "edge_head", "edge_seq", "edge_block", "edge_rank", "edge_len")}
    sp = ix.slot_ptr.copy()
    sp[1:] += 1
    rp = ix.row_ptr.copy()
    r0 = int(ix.edge_query[0]) * ix.num_kv_heads + int(ix.edge_head[0])
    rp[r0 + 1:] += 1
    re = np.insert(ix.row_edges + 1, int(ix.row_ptr[r0]), 0).astype(np.int32)
    return dataclasses.replace(ix, **f, slot_ptr=sp, row_ptr=rp, row_edges=re)


def _relayout(ix, **changes):
    """The index with fields of its layout replaced (the layout is one record, shared)."""
    return dataclasses.replace(ix, layout=dataclasses.replace(ix.layout, **changes))


# name -> (tampering, rule); each yields an index build_kvouter_index cannot have made
TAMPER = {
    "edge_len one longer (reads past L_b or into the future)":
        (lambda ix: dataclasses.replace(ix, edge_len=np.where(ix.edge_len < ix.block_size, ix.edge_len + 1,
                                                              ix.edge_len).astype(np.int32)), "R13"),
    "edge_len zero": (lambda ix: dataclasses.replace(ix, edge_len=_shift(ix.edge_len, 0, -int(ix.edge_len[0]))), "R13"),
    "edge_block >= msb": (lambda ix: dataclasses.replace(ix, edge_block=np.full_like(ix.edge_block, ix.msb)), "R13"),
    "edge_block of one edge moved": (lambda ix: dataclasses.replace(
        ix, edge_block=_shift(ix.edge_block, 0, 1 if ix.edge_block[0] + 1 < ix.msb else -1)), "R13"),
    "slot_block negative": (lambda ix: dataclasses.replace(ix, slot_block=np.full_like(ix.slot_block, -1)), "R13"),
    "slot_seq >= B": (lambda ix: dataclasses.replace(ix, slot_seq=_shift(ix.slot_seq, 0, 10)), "R13"),
    "edge_query >= Tq": (lambda ix: dataclasses.replace(ix, edge_query=_shift(ix.edge_query, -1, 100)), "R13"),
    "edge_query negative": (lambda ix: dataclasses.replace(ix, edge_query=_shift(ix.edge_query, 0, -100)), "R13"),
    "edge_head >= Hkv": (lambda ix: dataclasses.replace(ix, edge_head=_shift(ix.edge_head, -1, 1)), "R13"),
    "edge_seq of another sequence": (lambda ix: dataclasses.replace(ix, edge_seq=_shift(ix.edge_seq, 0, 1)), "R13"),
    "row_edges out of range": (lambda ix: dataclasses.replace(ix, row_edges=_shift(ix.row_edges, 0, 1000)), "R13"),
    "row_edges repeats an edge": (lambda ix: dataclasses.replace(
        ix, row_edges=np.concatenate([ix.row_edges[:1], ix.row_edges[:-1]]).astype(np.int32)), "R13"),
    "row_ptr past E": (lambda ix: dataclasses.replace(ix, row_ptr=_shift(ix.row_ptr, -1, 1)), "R13"),
    "slot_ptr shifted": (lambda ix: dataclasses.replace(ix, slot_ptr=_shift(ix.slot_ptr, 1, 1)), "R13"),
    "a repeated edge": (_dup_first_edge, "R13"),
    "used_kv_lens longer than the edges say": (lambda ix: _relayout(
        ix, used_kv_lens=np.minimum(ix.used_kv_lens + 1, ix.msb * ix.block_size).astype(np.int32)), "R13"),
    "causal flipped": (lambda ix: _relayout(ix, causal=not ix.causal), "R13"),
    "cu_seqlens_q moved": (lambda ix: _relayout(ix, cu_seqlens_q=_shift(ix.cu_seqlens_q, 1, 1)), "R13"),
    "page_size other than the cache's": (lambda ix: _relayout(ix, page_size=ix.page_size * 2,
                                                              block_size=ix.block_size * 2), "R13"),
    "layout not a SeqLayout": (lambda ix: dataclasses.replace(ix, layout=vars(ix.layout)), "R13"),
    "block_tables holds -2": (lambda ix: _relayout(ix, block_tables=np.where(
        ix.block_tables < 0, -2, ix.block_tables).astype(np.int32)), "R2"),
    "int64 edge arrays": (lambda ix: dataclasses.replace(ix, edge_len=ix.edge_len.astype(np.int64)), "R13"),
    "a list instead of an array": (lambda ix: dataclasses.replace(ix, edge_query=ix.edge_query.tolist()), "R13"),
    "num_queries negative": (lambda ix: dataclasses.replace(ix, num_queries=-1), "R13"),
}


@pytest.mark.parametrize("name", list(TAMPER))
def test_R13_a_tampered_index_is_refused_before_any_kernel(backend, name):
    """forward_partials and combine_partials accept only an index build_kvouter_index could have
    made: every id in range, every edge length the R13 formula, slots and rows consistent. (A
    longer edge_len made the wgpu kernel read the NaN past L_b: the kernels trust these arrays.)"""
    pb = _poisoned()
    ix = _index(pb)
    tamper, rule = TAMPER[name]
    bad = tamper(ix)
    part = psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, ix, backend="numpy")
    with no_device_work(backend) as hits:
        with pytest.raises(psa.SpecError, match=rf"\[{rule}\]$"):
            psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, bad, backend=backend)
        if rule == "R13" and name != "a repeated edge":  # same E: the partials fit, the index does not
            with pytest.raises(psa.SpecError, match=r"\[R13\]$"):
                psa.combine_partials(part, bad)
    assert not hits


def test_R13_a_rebuilt_index_passes_and_is_exact(backend):
    """The deep checks accept what build_kvouter_index makes (a copy of it included)."""
    pb = _poisoned()
    ix = _index(pb)
    def arrays_copied(rec):
        return dataclasses.replace(rec, **{f.name: np.array(getattr(rec, f.name)) for f in dataclasses.fields(rec)
                                           if isinstance(getattr(rec, f.name), np.ndarray)})

    copy = dataclasses.replace(arrays_copied(ix), layout=arrays_copied(ix.layout))
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    out, lse = psa.combine_partials(psa.forward_partials(pb.q, pb.k_cache, pb.v_cache, copy, backend=backend), copy)
    assert_attention_close(out, ref, dtype=np.float32, lse=lse, ref_lse=ref_lse, err_msg=f"[{backend.name}]")


# --- NaN / Inf in attended data, float16 overflow ---------------------------------------------------

@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("cache", ["k", "v"])
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_R11_non_finite_attended_data_reaches_only_the_rows_that_attend_it(backend, shape, cache, value):
    """A NaN/Inf in an attended cache cell gives exactly the reference's non-finite pattern:
    NaN in K makes the whole (t, hq) row and its lse NaN, NaN in V dimension d makes out[t, hq, d]
    NaN; rows that do not attend the cell are untouched (never silently dropped or zeroed).
    "decode" (one query per sequence) is the shape GPU backends may run with a special kernel."""
    seqlens, G = ((3, 2), 2) if shape == "prefill" else ((1, 1, 1), 4)
    pb = random_problem(11, seqlens_q=seqlens, Hkv=2, G=G, D=4, page_size=2, ppb=2, msb=3, used="full",
                      poison=False, hole_prob=0.0)
    mask = attended_mask(pb)  # [Tq, Hkv, pos]
    t, h, pos = (int(x[0]) for x in np.nonzero(mask))  # the first attended cell
    b = int(np.searchsorted(pb.cu_seqlens_q, t, side="right")) - 1
    page = int(pb.block_tables[b, pos // pb.page_size])
    k, v = pb.k_cache.copy(), pb.v_cache.copy()
    (k if cache == "k" else v)[page, h, pos % pb.page_size, 1] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, ref_lse = psa.dense_reference(pb.q, k, v, *pb.args[3:], **pb.options)
        out, lse = psa.forward(pb.q, k, v, *pb.args[3:], **pb.options, backend=backend, return_lse=True)
        ix = _index(pb)
        out2, lse2 = psa.combine_partials(psa.forward_partials(pb.q, k, v, ix, backend=backend), ix)
    clean_ref, clean_lse = psa.dense_reference(*pb.args, **pb.options)
    assert not np.array_equal(ref, clean_ref), "the poisoned cell must matter to the reference"
    touched = np.zeros(pb.q.shape[:2], dtype=bool)  # (t, hq) rows whose attended set holds the cell
    for t2 in range(pb.q.shape[0]):
        b2 = int(np.searchsorted(pb.cu_seqlens_q, t2, side="right")) - 1
        if b2 == b and mask[t2, h, pos]:
            touched[t2, h * pb.group_size:(h + 1) * pb.group_size] = True
    assert touched.any() and not touched.all()
    for got, got_lse, how in ((out, lse, "forward"), (out2, lse2, "partials + combine")):
        assert_attention_close(got, clean_ref, dtype=np.float32, lse=got_lse, ref_lse=clean_lse, rows=~touched,
                               err_msg=f"[{backend.name}] {how}, rows that do not attend the cell:")
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(got), test(ref), err_msg=f"[{backend.name}] {how}: {test.__name__}(out)")
            np.testing.assert_array_equal(test(got_lse), test(ref_lse), err_msg=f"[{backend.name}] {how}: {test.__name__}(lse)")
        clean = np.isfinite(ref).all(axis=-1)
        assert clean.any(), "some rows must stay clean"
        assert_attention_close(got, ref, dtype=np.float32, lse=got_lse, ref_lse=ref_lse,
                               rows=clean & np.isfinite(ref_lse), err_msg=f"[{backend.name}] {how}:")


@pytest.mark.parametrize("regime", ["moderate logits", "huge logits"])
def test_R12_float16_data_whose_products_overflow_float16_stay_exact(backend, regime):
    """|q|, |k| ~ 250 and D = 32: every q.k is ~2e6, far beyond float16's 65504, and |v| ~ 6e4
    makes sums of V overflow float16 too; scores and sums are float32, so the result is finite
    and as exact as float16 data allow (R12, R20)."""
    if "float16" not in backend.capabilities.dtypes:
        pytest.skip(f"backend {backend.name!r} does not run float16")
    rng = np.random.default_rng(3)
    pb = random_problem(12, seqlens_q=(3, 2), Hkv=1, G=2, D=32, page_size=4, ppb=2, msb=3, used="full",
                      poison=False, hole_prob=0.0, dtype=np.float16, q_dtype=np.float16)
    sign = lambda shape: rng.choice([-1.0, 1.0], size=shape)  # noqa: E731
    q = (sign(pb.q.shape) * rng.uniform(200, 250, pb.q.shape)).astype(np.float16)
    k = (sign(pb.k_cache.shape) * rng.uniform(200, 250, pb.k_cache.shape)).astype(np.float16)
    v = (sign(pb.v_cache.shape) * rng.uniform(5e4, 6e4, pb.v_cache.shape)).astype(np.float16)
    scale = 1e-5 if regime == "moderate logits" else None  # None: 1/sqrt(D), logits ~ 1e5
    prods = np.abs(np.einsum("thd,psd->thps", q.astype(np.float64), k[:, 0].astype(np.float64)))
    assert prods.max() > 65504, "the products must overflow float16"
    args = (q, k, v, *pb.args[3:])
    kwargs = {**pb.options, "softmax_scale": scale}
    ref, ref_lse = psa.dense_reference(*args, **kwargs)
    out, lse = psa.forward(*args, **kwargs, backend=backend, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse[np.isfinite(ref_lse)]).all()
    assert_attention_close(out, ref, dtype=np.float16, lse=lse, ref_lse=ref_lse, err_msg=f"[{backend.name}] {regime}:")


def test_R16_merge_states_propagates_nan():
    """Merging a NaN state gives NaN (it is not mistaken for the empty state (0, -inf))."""
    o = np.ones((2, 3), np.float32)
    lse = np.zeros(2, np.float32)
    o_nan, lse_nan = np.full_like(o, np.nan), np.array([np.nan, 0.0], np.float32)
    mo, ml = psa.merge_states(o_nan, lse_nan, o, lse)
    assert np.isnan(mo[0]).all() and np.isnan(ml[0])
    mo, ml = psa.merge_states(o, lse, o, np.full(2, -np.inf, np.float32))
    np.testing.assert_array_equal(mo, o)


@pytest.mark.parametrize("bad", ["shape", "dtype", "none", "scalar", "string"])
def test_R17_merge_states_refuses_bad_states_cleanly(bad):
    o = np.ones((3, 2, 4), np.float32)
    lse = np.zeros((3, 2), np.float32)
    args = {"shape": (o, lse, o[:, :1], lse), "dtype": (o.astype(np.int32), lse, o, lse),
            "none": (o, None, o, lse), "scalar": (o, lse, 1.0, lse), "string": (o, lse, o, "lse")}[bad]
    _spec_error(lambda: psa.merge_states(*args), ("merge_states",), "R16", f"merge_states with a bad {bad}")
