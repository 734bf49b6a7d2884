"""R17/R18: every violation of R1-R8 raises SpecError naming the rule; valid edge cases run;
the registry reports, never crashes, and never falls back silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn import registry
from paged_sparse_attn.testing import assert_attention_close
from paged_sparse_attn.testing.generate import random_problem

f32 = np.float32


# --- a valid base problem: Tq=4, Hq=4, Hkv=2, D=3, P=5, S=2, block_size=2 -> msb=8 -------------

def base() -> dict:
    rng = np.random.default_rng(0)
    sel = np.array([
        [[0, 3, -1], [7, -1, -1]],
        [[1, 2, 5], [-1, -1, -1]],
        [[-1, 0, 4], [6, 1, 0]],
        [[0, 1, 2], [3, -1, 4]],
    ])
    bt = np.array([[0, 1, -1, 2, 3, -1, 4, 0],
                   [4, -1, -1, -1, -1, -1, -1, -1]])
    return dict(
        q=rng.standard_normal((4, 4, 3)).astype(f32),
        k=rng.standard_normal((5, 2, 2, 3)).astype(f32),
        v=rng.standard_normal((5, 2, 2, 3)).astype(f32),
        bt=bt, sel=sel, cu=np.array([0, 3, 4]), lens=np.array([16, 5]),
        block_size=2, page_size=2, scale=None, causal=False,
    )


def call_forward(d):
    return psa.forward(d["q"], d["k"], d["v"], d["bt"], d["sel"], d["cu"], used_kv_lens=d["lens"],
                       block_size=d["block_size"], softmax_scale=d["scale"], causal=d["causal"],
                       backend="numpy")


def call_dense(d):
    return psa.dense_reference(d["q"], d["k"], d["v"], d["bt"], d["sel"], d["cu"], used_kv_lens=d["lens"],
                               block_size=d["block_size"], softmax_scale=d["scale"], causal=d["causal"])


def call_index(d):
    return psa.build_kvouter_index(d["sel"], d["bt"], d["cu"], d["lens"], block_size=d["block_size"],
                                   page_size=d["page_size"], causal=d["causal"])


def call_partials(d):
    index = d.get("index")
    if index is None:
        v = base()
        index = psa.build_kvouter_index(v["sel"], v["bt"], v["cu"], v["lens"], block_size=2, page_size=2)
    return psa.forward_partials(d["q"], d["k"], d["v"], index, softmax_scale=d["scale"], backend="numpy")


CALLS = {"forward": call_forward, "dense_reference": call_dense, "build_kvouter_index": call_index,
         "forward_partials": call_partials}
ARRAYS = ("forward", "dense_reference", "forward_partials")  # take q / k / v
LAYOUT = ("forward", "dense_reference", "build_kvouter_index")  # take the index arrays
WITH_CACHE = ("forward", "dense_reference")  # know P and Hkv as well as the layout


def _set(key, value):
    return lambda d: {**d, key: value(d) if callable(value) else value}


def _edit(key, fn):
    def mut(d):
        a = np.array(d[key])
        fn(a)
        return {**d, key: a}
    return mut


def _i(x, idx, val):
    x[idx] = val


# (case id, functions, mutation, rule, message fragment (regex))
CASES = [
    # R1 shapes
    ("q_ndim", ARRAYS, _set("q", lambda d: d["q"][0]), "R1", r"q must be 3-D"),
    ("k_ndim", ARRAYS, _set("k", lambda d: d["k"][0]), "R1", r"k_cache must be 4-D"),
    ("v_ndim", ARRAYS, _set("v", lambda d: d["v"][..., 0]), "R1", r"v_cache must be 4-D"),
    ("hq_not_multiple", ARRAYS, _set("q", lambda d: d["q"][:, :3]), "R1", r"Hq"),
    ("head_dim_mismatch", ARRAYS, _set("q", lambda d: np.zeros((4, 4, 4), f32)), "R1", r"head_dim"),
    ("kv_shape_mismatch", ARRAYS, _set("v", lambda d: d["v"][:4]), "R1", r"same shape"),
    ("kv_dtype_mismatch", ARRAYS, _set("v", lambda d: d["v"].astype(np.float16)), "R1", r"dtype"),
    ("zero_kv_heads", ARRAYS, lambda d: {**d, "k": d["k"][:, :0], "v": d["v"][:, :0]}, "R1", r"KV head|Hkv"),
    # R7 float dtypes: refused, never cast
    ("q_float64", ARRAYS, _set("q", lambda d: d["q"].astype(np.float64)), "R7", r"q must have dtype in .*got float64"),
    ("k_float64", ARRAYS, _set("k", lambda d: d["k"].astype(np.float64)), "R7", r"k_cache must have dtype.*got float64"),
    ("q_int", ARRAYS, _set("q", lambda d: d["q"].astype(np.int32)), "R7", r"got int32"),
    ("q_list", ARRAYS, _set("q", lambda d: d["q"].tolist()), "R7", r"q must (be an array|have dtype in .*got float64)"),
    ("q_none", ARRAYS, _set("q", None), "R7", r"q must be an array, got NoneType"),
    ("k_scalar", ARRAYS, _set("k", 1.0), "R7", r"k_cache must be an array, got float"),
    # R7 index dtypes
    ("bt_bool", LAYOUT, _set("bt", lambda d: d["bt"] >= 0), "R7", r"block_tables must have an integer dtype, got bool"),
    ("sel_float", LAYOUT, _set("sel", lambda d: d["sel"].astype(np.float32)), "R7", r"selected must have an integer dtype, got float32"),
    ("cu_float", LAYOUT, _set("cu", lambda d: d["cu"].astype(float)), "R7", r"cu_seqlens_q must have an integer dtype"),
    ("lens_float", LAYOUT, _set("lens", lambda d: d["lens"].astype(float)), "R7", r"used_kv_lens must have an integer dtype"),
    ("bt_not_int32", LAYOUT, _set("bt", lambda d: np.where(d["bt"] == 4, 2 ** 40, d["bt"])), "R7",
     r"block_tables values must fit int32, got 1099511627776"),
    ("sel_uint64_huge", LAYOUT, _set("sel", lambda d: np.full((4, 2, 3), 2 ** 63, np.uint64)), "R7", r"selected values must fit int32"),
    ("lens_not_int32", LAYOUT, _set("lens", lambda d: np.array([16, -2 ** 35])), "R7", r"fit int32"),
    # R2 block tables
    ("bt_below_minus_one", LAYOUT, _edit("bt", lambda a: _i(a, (1, 3), -2)), "R2", r"block_tables contains -2 at \[1, 3\]"),
    ("bt_page_out_of_range", WITH_CACHE, _edit("bt", lambda a: _i(a, (0, 5), 5)), "R2", r"block_tables contains 5 at \[0, 5\], expected -1 or a page id in \[0, 5\)"),
    ("bt_ndim", LAYOUT, _set("bt", lambda d: d["bt"][0]), "R2", r"block_tables must be 2-D"),
    # R3 cu_seqlens
    ("cu_length", LAYOUT, _set("cu", np.array([0, 4])), "R3", r"B\+1=3"),
    ("cu_first", LAYOUT, _set("cu", np.array([1, 3, 4])), "R3", r"cu_seqlens_q\[0\] must be 0, got 1"),
    ("cu_decreasing", LAYOUT, _set("cu", np.array([0, 5, 4])), "R3", r"non-decreasing"),
    ("cu_last", LAYOUT, _set("cu", np.array([0, 3, 3])), "R3", r"cu_seqlens_q\[-1\] must equal Tq=4, got 3"),
    ("cu_ndim", LAYOUT, _set("cu", np.array([[0, 3, 4]])), "R3", r"cu_seqlens_q must be 1-D"),
    # R4 used_kv_lens
    ("lens_negative", LAYOUT, _set("lens", np.array([16, -1])), "R4", r"used_kv_lens\[1\]=-1 is outside \[0, msb\*block_size=16\]"),
    ("lens_too_long", LAYOUT, _set("lens", np.array([17, 5])), "R4", r"used_kv_lens\[0\]=17 is outside"),
    ("lens_length", LAYOUT, _set("lens", np.array([16])), "R4", r"used_kv_lens must have B=2 entries, got 1"),
    # R5 block size
    ("bs_not_multiple", LAYOUT, _set("block_size", 3), "R5", r"block_size must be a multiple of page_size=2, got 3"),
    ("bs_zero", LAYOUT, _set("block_size", 0), "R5", r"block_size must be a positive int, got 0"),
    ("bs_negative", LAYOUT, _set("block_size", -2), "R5", r"block_size must be a positive int, got -2"),
    ("bs_float", LAYOUT, _set("block_size", 2.0), "R5", r"block_size must be a positive int, got 2\.0"),
    ("bs_bool", LAYOUT, _set("block_size", True), "R5", r"block_size must be a positive int, got True"),
    ("bs_str", LAYOUT, _set("block_size", "2"), "R5", r"block_size must be a positive int"),
    ("msb_zero", LAYOUT, _set("block_size", 32), "R5", r"msb must be >= 1"),
    # R6 selected
    ("sel_too_big", LAYOUT, _edit("sel", lambda a: _i(a, (3, 0, 2), 9)), "R6", r"selected contains block id 9 >= msb=8 at \[3, 0, 2\]"),
    ("sel_below_minus_one", LAYOUT, _edit("sel", lambda a: _i(a, (1, 1, 0), -3)), "R6", r"selected contains block id -3 < -1 at \[1, 1, 0\]"),
    ("sel_duplicate", LAYOUT, _edit("sel", lambda a: _i(a, (2, 1, 2), 6)), "R6", r"selected row \[2, 1\] repeats block id 6"),
    ("sel_ndim", LAYOUT, _set("sel", lambda d: d["sel"][:, 0]), "R6", r"selected must be 3-D"),
    ("sel_heads", WITH_CACHE, _set("sel", lambda d: np.concatenate([d["sel"], d["sel"][:, :1]], axis=1)), "R6", r"selected must have shape \[Tq=4, Hkv=2, topk\]"),
    ("sel_rows", WITH_CACHE, _set("sel", lambda d: d["sel"][:3]), "R6", r"selected must have shape"),
    # R8 scale and causal
    ("scale_nan", ARRAYS, _set("scale", float("nan")), "R8", r"softmax_scale must be a finite float, got nan"),
    ("scale_inf", ARRAYS, _set("scale", float("inf")), "R8", r"softmax_scale must be a finite float, got inf"),
    ("scale_str", ARRAYS, _set("scale", "0.5"), "R8", r"softmax_scale must be a finite float"),
    ("scale_bool", ARRAYS, _set("scale", True), "R8", r"softmax_scale must be a finite float, got True"),
    ("causal_int", LAYOUT, _set("causal", 1), "R8", r"causal must be a bool, got 1"),
    ("causal_str", LAYOUT, _set("causal", "yes"), "R8", r"causal must be a bool, got 'yes'"),
    ("causal_none", LAYOUT, _set("causal", None), "R8", r"causal must be a bool, got None"),
    # build_kvouter_index's own page_size (R5)
    ("page_size_zero", ("build_kvouter_index",), _set("page_size", 0), "R5", r"page_size must be a positive int, got 0"),
    ("page_size_float", ("build_kvouter_index",), _set("page_size", 2.0), "R5", r"page_size must be a positive int"),
    ("page_size_bool", ("build_kvouter_index",), _set("page_size", True), "R5", r"page_size must be a positive int"),
]

PARAMS = [pytest.param(fn, mut, rule, frag, id=f"{cid}-{fn}")
          for cid, fns, mut, rule, frag in CASES for fn in fns]


@pytest.mark.parametrize("fn,mutate,rule,fragment", PARAMS)
def test_R17_violation_raises_spec_error_naming_the_rule(fn, mutate, rule, fragment):
    d = mutate(base())
    with pytest.raises(psa.SpecError, match=fragment) as ei:
        CALLS[fn](d)
    msg = str(ei.value)
    assert msg.startswith(f"{fn}(): "), msg
    assert msg.endswith(f"[{rule}]"), msg
    assert ei.value.rule == rule


@pytest.mark.parametrize("fn", list(CALLS))
def test_R17_base_problem_is_valid(fn):
    CALLS[fn](base())  # so that each violation above is the only thing wrong


def test_R17_exact_message_of_an_out_of_range_block_id():
    d = base()
    d["sel"] = d["sel"].copy()
    d["sel"][3, 0, 2] = 9
    with pytest.raises(psa.SpecError) as ei:
        call_forward(d)
    assert str(ei.value) == "forward(): selected contains block id 9 >= msb=8 at [3, 0, 2] [R6]"
    assert ei.value.rule == "R6"


def test_R17_arrays_changed_in_place_between_calls_are_checked_again():
    # the checks of an array equal to one that passed are not repeated: a change in place, a
    # change of dtype with the same bytes, or another cache size must be checked as new
    d = base()
    call_forward(d)
    d["bt"][1, 1] = 5  # P = 5: no such page
    with pytest.raises(psa.SpecError, match=r"block_tables contains 5 at \[1, 1\], expected -1 or a page id in \[0, 5\) \[R2\]"):
        call_forward(d)
    d["bt"][1, 1] = -1
    call_forward(d)
    d["lens"][1] = 17
    with pytest.raises(psa.SpecError, match=r"used_kv_lens\[1\]=17 is outside \[0, msb\*block_size=16\] \[R4\]"):
        call_forward(d)
    d["lens"][1] = 5
    d["cu"][1] = 5
    with pytest.raises(psa.SpecError, match=r"non-decreasing, got 5 then 4 at \[1, 2\] \[R3\]"):
        call_forward(d)
    d["cu"][1] = 3
    call_forward(d)
    with pytest.raises(psa.SpecError, match=r"block_tables must have an integer dtype, got float64 \[R7\]"):
        call_forward({**d, "bt": d["bt"].view(np.float64)})  # the same bytes read as floats
    with pytest.raises(psa.SpecError, match=r"block_tables contains 4 at \[0, 6\], expected -1 or a page id in \[0, 4\) \[R2\]"):
        call_forward({**d, "k": d["k"][:4], "v": d["v"][:4]})  # fewer pages than the call before


def test_R6_range_check_at_the_int32_edges():
    for bad, rel in ((2**31 - 1, ">= msb=8"), (-2, "< -1"), (-2**31, "< -1"), (8, ">= msb=8")):
        d = base()
        d["sel"] = d["sel"].astype(np.int64)
        d["sel"][2, 1, 1] = bad
        with pytest.raises(psa.SpecError) as ei:
            call_forward(d)
        assert str(ei.value) == f"forward(): selected contains block id {bad} {rel} at [2, 1, 1] [R6]"


def test_R6_equal_ids_in_neighbouring_rows_are_not_repeats():
    d = base()
    # each row's largest id is the next row's smallest: adjacent after sorting, in different rows
    d["sel"] = np.array([[[0, 3, -1], [3, 5, -1]],
                         [[5, 6, -1], [6, 7, -1]],
                         [[7, -1, -1], [-1, 7, -1]],
                         [[-1, 7, 2], [2, -1, -1]]])
    call_forward(d)
    d["sel"][3, 1, 2] = 2
    with pytest.raises(psa.SpecError) as ei:
        call_forward(d)
    assert str(ei.value) == "forward(): selected row [3, 1] repeats block id 2; ids must be unique per row [R6]"


def test_R17_spec_error_is_a_value_error_with_a_rule():
    assert issubclass(psa.SpecError, ValueError)
    assert issubclass(psa.SpecError, psa.PagedSparseAttnError)
    assert issubclass(psa.UnsupportedError, NotImplementedError)
    assert issubclass(psa.BackendUnavailableError, RuntimeError)
    d = base()
    d["causal"] = "yes"
    with pytest.raises(ValueError) as ei:
        call_forward(d)
    assert ei.value.rule == "R8"


# --- forward_partials / combine_partials specific (R13, R14) -----------------------------------

def _index_of(d, **over):
    kw = dict(block_size=2, page_size=2, causal=False)
    kw.update(over)
    return psa.build_kvouter_index(d["sel"], d["bt"], d["cu"], d["lens"], **kw)


def test_R13_forward_partials_refuses_a_foreign_index():
    d = base()
    with pytest.raises(psa.SpecError, match=r"index must be a KVOuterIndex.*\[R13\]"):
        call_partials({**d, "index": {"edges": []}})
    with pytest.raises(psa.SpecError, match=r"built for Tq=4 queries, q has 3 \[R13\]"):
        call_partials({**d, "q": d["q"][:3]})
    with pytest.raises(psa.SpecError, match=r"page_size=4, k_cache has 2 \[R13\]"):
        call_partials({**d, "index": _index_of(d, block_size=4, page_size=4)})
    with pytest.raises(psa.SpecError, match=r"Hkv=2 KV heads, k_cache has 1 \[R13\]"):
        call_partials({**d, "q": d["q"][:, :2], "k": d["k"][:, :1], "v": d["v"][:, :1]})
    with pytest.raises(psa.SpecError, match=r"block_tables contains 4 at \[0, 6\], expected -1 or a page id in \[0, 4\) \[R2\]"):
        call_partials({**d, "k": d["k"][:4], "v": d["v"][:4]})


def test_R14_combine_partials_checks_shapes():
    d = base()
    ix = _index_of(d)
    E = ix.num_edges
    good = psa.Partials(np.zeros((E, 2, 3), f32), np.zeros((E, 2), f32), np.ones((E, 2), f32))
    psa.combine_partials(good, ix)
    bad = psa.Partials(np.zeros((E + 1, 2, 3), f32), np.zeros((E + 1, 2), f32), np.ones((E + 1, 2), f32))
    with pytest.raises(psa.SpecError, match=r"partials must be o \[E=\d+, G, D\].*\[R14\]"):
        psa.combine_partials(bad, ix)
    with pytest.raises(psa.SpecError, match=r"\[R14\]"):
        psa.combine_partials((good.o, good.m, good.l), ix)


# --- valid edge cases ---------------------------------------------------------------------------

def _check_against_reference(q, k, v, bt, sel, cu, lens=None, block_size=2, causal=False):
    out, lse = psa.forward(q, k, v, bt, sel, cu, used_kv_lens=lens, block_size=block_size, causal=causal,
                           backend="numpy", return_lse=True)
    ref, ref_lse = psa.dense_reference(q, k, v, bt, sel, cu, used_kv_lens=lens, block_size=block_size,
                                       causal=causal)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert_attention_close(out, ref, dtype=f32, lse=lse, ref_lse=ref_lse)
    return out, lse


def test_R3_zero_queries():
    d = base()
    out, lse = _check_against_reference(d["q"][:0], d["k"], d["v"], d["bt"], d["sel"][:0], np.array([0, 0, 0]), d["lens"])
    assert out.shape == (0, 4, 3) and lse.shape == (0, 4)


def test_R3_zero_sequences():
    d = base()
    out, lse = _check_against_reference(d["q"][:0], d["k"], d["v"], d["bt"][:0], d["sel"][:0], np.array([0]),
                                        np.zeros(0, np.int64))
    assert out.shape == (0, 4, 3)


def test_R6_topk_zero_gives_empty_rows():
    d = base()
    out, lse = _check_against_reference(d["q"], d["k"], d["v"], d["bt"], d["sel"][:, :, :0], d["cu"], d["lens"])
    assert (out == 0).all() and np.isneginf(lse).all()


def test_R3_empty_sequences_between_others():
    pb = random_problem(7, seqlens_q=(0, 2, 0, 0, 1, 0), used="random")
    _check_against_reference(*pb.args, pb.used_kv_lens, block_size=pb.block_size)


def test_R2_no_pages_at_all():
    # P = 0: every block table entry must be -1; every selected block is then empty
    q = np.ones((2, 2, 3), f32)
    k = np.zeros((0, 1, 2, 3), f32)
    bt = np.full((1, 4), -1)
    sel = np.array([[[0, 1]], [[1, -1]]])
    out, lse = _check_against_reference(q, k, k, bt, sel, np.array([0, 2]), block_size=4)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_R1_non_contiguous_and_read_only_inputs():
    pb = random_problem(9, seqlens_q=(3, 2), Hkv=2, G=2, D=4, poison=False)
    ref, ref_lse = psa.dense_reference(*pb.args, **pb.options)
    # strided views holding the same values
    q_big = np.zeros((pb.q.shape[0], pb.q.shape[1] * 2, pb.q.shape[2]), f32)
    q_big[:, ::2] = pb.q
    k_f = np.asfortranarray(pb.k_cache)
    v_t = np.ascontiguousarray(pb.v_cache.transpose(3, 2, 1, 0)).transpose(3, 2, 1, 0)
    sel_f = np.asfortranarray(pb.selected)
    bt_rev = np.ascontiguousarray(pb.block_tables[:, ::-1])[:, ::-1]
    args = [q_big[:, ::2], k_f, v_t, bt_rev, sel_f, pb.cu_seqlens_q.copy()]
    assert not args[0].flags.c_contiguous and not args[2].flags.c_contiguous and not args[3].flags.c_contiguous
    lens = pb.used_kv_lens.copy()
    for a in [*args, lens]:
        a.flags.writeable = False
    out, lse = psa.forward(*args, **{**pb.options, "used_kv_lens": lens}, backend="numpy", return_lse=True)
    assert_attention_close(out, ref, dtype=f32, lse=lse, ref_lse=ref_lse)
    ix = psa.build_kvouter_index(sel_f, bt_rev, args[5], lens, block_size=pb.block_size, page_size=pb.page_size,
                                 causal=pb.causal)
    pt = psa.forward_partials(args[0], k_f, v_t, ix, backend="numpy")
    out2, _ = psa.combine_partials(pt, ix)
    assert_attention_close(out2, ref, dtype=f32)


def test_R17_inputs_are_not_modified():
    pb = random_problem(10, seqlens_q=(2, 2))
    before = [a.copy() for a in pb.args]
    psa.forward(*pb.args, **pb.options, backend="numpy")
    for a, b in zip(pb.args, before):
        np.testing.assert_array_equal(a, b)


# --- import hygiene and the registry (R18) ----------------------------------------------------

def test_import_does_not_import_wgpu():
    src = str(Path(psa.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, paged_sparse_attn as p; p.forward; "
            "bad = [m for m in sys.modules if m == 'wgpu' or m.startswith('wgpu.')]; "
            "assert not bad, bad; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.fixture
def clean_registry():
    """Undo registrations made by a test (the registry is process-global)."""
    with registry.registry_scope():
        yield


def test_R18_list_backends_never_raises_and_reports_numpy(clean_registry):
    def boom():
        raise RuntimeError("no such device here")

    psa.register_backend("t-broken-factory", boom)
    psa.register_backend("t-missing-module", "paged_sparse_attn_no_such_module:Backend")
    got = psa.list_backends()
    assert isinstance(got, dict)
    assert all(isinstance(a, psa.Availability) for a in got.values())
    assert got["numpy"].ok and "numpy" in got["numpy"].reason
    assert "wgpu" in got  # built-in, available or not, with a reason
    assert got["wgpu"].reason
    assert not got["t-broken-factory"].ok and "no such device here" in got["t-broken-factory"].reason
    assert not got["t-missing-module"].ok and "paged_sparse_attn_no_such_module" in got["t-missing-module"].reason
    with pytest.raises(psa.BackendUnavailableError, match="no such device here"):
        psa.get_backend("t-broken-factory")


def test_R18_unknown_backend_names_the_registered_ones():
    with pytest.raises(psa.BackendUnavailableError) as ei:
        psa.get_backend("nope")
    msg = str(ei.value)
    assert "'nope'" in msg and "numpy" in msg and "wgpu" in msg
    d = base()
    with pytest.raises(psa.BackendUnavailableError, match="nope"):
        psa.forward(d["q"], d["k"], d["v"], d["bt"], d["sel"], d["cu"], block_size=2, backend="nope")


def test_R18_a_probe_that_says_no_is_reported_and_refused(clean_registry):
    from paged_sparse_attn.backends.numpy_backend import NumpyBackend

    class Absent(NumpyBackend):
        name = "t-absent"

        @classmethod
        def probe(cls):
            return psa.Availability(False, "needs a frobnicator; install frob")

    psa.register_backend("t-absent", Absent)
    assert psa.list_backends()["t-absent"] == psa.Availability(False, "needs a frobnicator; install frob")
    with pytest.raises(psa.BackendUnavailableError, match="install frob"):
        psa.get_backend("t-absent")


def test_R18_register_and_use_backend(clean_registry):
    from paged_sparse_attn.backends.numpy_backend import NumpyBackend

    calls = []

    class Counting(NumpyBackend):
        name = "t-counting"

        def forward_partials(self, problem, index):
            calls.append(index.num_edges)
            return super().forward_partials(problem, index)

    psa.register_backend("t-counting", Counting)
    with pytest.raises(ValueError, match="already registered"):
        psa.register_backend("t-counting", Counting)
    assert psa.list_backends()["t-counting"].ok
    be = psa.get_backend("t-counting")
    assert isinstance(be, Counting) and psa.get_backend("t-counting") is be
    d = base()
    args = (d["q"], d["k"], d["v"], d["bt"], d["sel"], d["cu"])
    ref = psa.forward(*args, block_size=2, backend="numpy")
    with psa.use_backend("t-counting") as active:
        assert active is be
        out = psa.forward(*args, block_size=2)
    assert len(calls) == 1
    np.testing.assert_array_equal(out, ref)
    psa.forward(*args, block_size=2)  # default again: numpy
    assert len(calls) == 1
    # invalid inputs never reach the backend (R17: validation comes first)
    with psa.use_backend("t-counting"):
        with pytest.raises(psa.SpecError):
            psa.forward(*args, block_size=3)
    assert len(calls) == 1


def test_R18_unsupported_dtype_names_the_backend(clean_registry):
    from paged_sparse_attn.backends.numpy_backend import NumpyBackend

    class F32Only(NumpyBackend):
        name = "t-f32only"

        @property
        def capabilities(self):
            return psa.Capabilities(dtypes=("float32",))

    psa.register_backend("t-f32only", F32Only)
    pb = random_problem(1, dtype=np.float16)
    with pytest.raises(psa.UnsupportedError, match=r"'t-f32only'.*float16.*\[R18\]"):
        psa.forward(*pb.args, **pb.options, backend="t-f32only")
