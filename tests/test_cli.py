"""The command line (`paged-sparse-attn`) and the demo behind it.

Rule ids in test names: R5/R7/R18 are the errors the CLI prints in one line; R9/R10/R20 are what
the demo checks (causal selection, poisoned memory, dtype-derived tolerance).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn import cli, demo, registry
from paged_sparse_attn.backends.numpy_backend import NumpyBackend
from paged_sparse_attn.reference import attended_positions

typer_testing = pytest.importorskip("typer.testing", reason="the cli extra (typer) is not installed")

SMALL = ["--seqs", "2", "--max-len", "192", "--queries", "10", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "16", "--page-size", "8", "--block-size", "32", "--topk", "3", "--repeat", "1"]
SMALL_SIZES = demo.DemoSizes(seqs=2, max_len=192, queries=10, q_heads=4, kv_heads=2, head_dim=16,
                             page_size=8, block_size=32, topk=3)
SRC = str(Path(psa.__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def app():
    return cli.build_app()


def invoke(app, args):
    # a wide terminal, so that rich does not fold the names the tests look for
    return typer_testing.CliRunner().invoke(app, args, env={"COLUMNS": "240"})


@pytest.fixture
def isolated_registry():
    """Registrations made in a test disappear after it."""
    with registry.registry_scope():
        yield registry


class OffBackend(NumpyBackend):
    """Numpy, plus a small error: the demo must catch it."""

    name = "off-by-a-bit"

    def forward(self, problem, index):
        out, lse = super().forward(problem, index)
        return out + np.float32(1e-3), lse


class FailingBackend(NumpyBackend):
    name = "failing"

    def forward_partials(self, problem, index):
        raise psa.DeviceError("kv_outer_forward: device lost (E=12)")


# ------------------------------------------------------------------------------------ help


@pytest.mark.parametrize("args", [[], ["backends"], ["demo"], ["bench"], ["check"]])
def test_help_everywhere(app, args):
    res = invoke(app, [*args, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


def test_version(app):
    res = invoke(app, ["--version"])
    assert res.exit_code == 0 and psa.__version__ in res.output


# ------------------------------------------------------------------------------- backends


def test_backends_table_lists_every_registered_backend(app):
    res = invoke(app, ["backends"])
    assert res.exit_code == 0, res.output
    for name in psa.list_backends():
        assert name in res.output


def test_backends_json_matches_registry_and_capabilities(app):
    res = invoke(app, ["backends", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    listed = psa.list_backends()
    assert [b["name"] for b in info["backends"]] == list(listed)
    assert info["default"] == psa.get_backend().name
    for row in info["backends"]:
        if row["available"]:
            caps = psa.get_backend(row["name"]).capabilities
            assert row["capabilities"] == json.loads(json.dumps(cli.capabilities_dict(caps)))
            assert row["capabilities"]["device"] == caps.device
        else:
            assert row["capabilities"] is None and row["reason"] == listed[row["name"]].reason
    numpy_row = next(b for b in info["backends"] if b["name"] == "numpy")
    assert numpy_row["available"] and "float32" in numpy_row["capabilities"]["dtypes"]


def test_backends_shows_gpu_features_and_limits(app, isolated_registry):
    class FakeGpu(NumpyBackend):
        name = "fake-gpu"

        @property
        def capabilities(self):
            return psa.Capabilities(features=frozenset({"shader-f16", "timestamp-query"}),
                                    limits={"max_storage_buffer_binding_size": 128 << 20,
                                            "max_compute_workgroup_storage_size": 32768},
                                    device="FakeAdapter (Vulkan)")

    psa.register_backend("fake-gpu", FakeGpu)
    res = invoke(app, ["backends", "--json"])
    row = next(b for b in json.loads(res.stdout)["backends"] if b["name"] == "fake-gpu")
    assert row["capabilities"]["features"] == ["shader-f16", "timestamp-query"]
    assert row["capabilities"]["limits"]["max_compute_workgroup_storage_size"] == 32768
    table = invoke(app, ["backends"]).output
    assert "FakeAdapter (Vulkan)" in table
    assert "shader-f16 ✓" in table and "subgroup ✗" in table and "32 KiB" in table


def test_backends_reports_backend_failing_to_start_R18(app, isolated_registry):
    def factory():
        raise RuntimeError("adapter vanished")

    psa.register_backend("flaky", factory)
    res = invoke(app, ["backends", "--json"])
    assert res.exit_code == 0
    row = next(b for b in json.loads(res.stdout)["backends"] if b["name"] == "flaky")
    assert row["available"] is False and "adapter vanished" in row["reason"]


# ------------------------------------------------------------------------------------ demo


def test_demo_agrees_with_reference_R20(app):
    res = invoke(app, ["demo", "--backend", "numpy", "--json", *SMALL])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["ok"] is True
    (row,) = rep["results"]
    assert row["status"] == "ok"
    assert 0 <= row["out_err"] <= row["out_tol"] and 0 <= row["lse_err"] <= row["lse_tol"]
    assert 0 < rep["attended"] < rep["visible"]


def test_demo_default_runs_every_available_backend(app):
    res = invoke(app, ["demo", *SMALL])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "(default)" in out and "OK" in out
    for name, avail in psa.list_backends().items():
        assert name in out  # run, or listed as skipped with its reason
        if not avail.ok:
            assert f"skipped {name}" in out


def test_demo_float16(app):
    res = invoke(app, ["demo", "--backend", "numpy", "--dtype", "float16", "--json", *SMALL])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["results"][0]["out_tol"] >= demo.tolerance(np.float16) > demo.tolerance(np.float32)


def test_demo_exits_1_when_a_backend_disagrees_R20(app, isolated_registry):
    psa.register_backend("off-by-a-bit", OffBackend)
    res = invoke(app, ["demo", "-b", "numpy", "-b", "off-by-a-bit", *SMALL])
    assert res.exit_code == 1, res.output
    assert "mismatch" in res.output and "FAILED" in res.output
    rep = json.loads(invoke(app, ["demo", "-b", "numpy", "-b", "off-by-a-bit", "--json", *SMALL]).stdout)
    assert [r["status"] for r in rep["results"]] == ["ok", "mismatch"]
    assert rep["results"][1]["out_err"] == pytest.approx(1e-3, rel=1e-3)


def test_demo_exits_1_when_a_backend_fails(app, isolated_registry):
    psa.register_backend("failing", FailingBackend)
    res = invoke(app, ["demo", "-b", "failing", *SMALL])
    assert res.exit_code == 1
    assert "device lost" in res.output


def test_demo_module_factory_backend(app, isolated_registry):
    res = invoke(app, ["demo", "-b", "paged_sparse_attn.backends.numpy_backend:NumpyBackend", "--json", *SMALL])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"][0]["status"] == "ok"


def test_unknown_backend_is_one_line_R18(app):
    res = invoke(app, ["demo", "--backend", "no-such-backend", *SMALL])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "no-such-backend" in lines[0] and "[R18]" in lines[0]
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args, rule", [(["--block-size", "20"], "R5"), (["--heads", "3"], "R1"),
                                        (["--dtype", "float64"], "R7")])
def test_bad_sizes_are_one_line_with_rule(app, args, rule):
    res = invoke(app, ["demo", *SMALL, *args])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"[{rule}]"), res.stderr


def test_error_line_appends_rule_once():
    assert cli.error_line(psa.SpecError("f(): bad x", "R6")) == "error: f(): bad x [R6]"
    assert cli.error_line(psa.SpecError("f(): bad x [R6]", "R6")) == "error: f(): bad x [R6]"
    assert cli.error_line(psa.DeviceError("line one\n  line two")) == "error: line one line two"


def test_error_line_in_a_real_process_R17():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "paged_sparse_attn.cli", "demo", "--topk", "-1"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_main_returns_exit_code(capsys):
    assert cli.main(["backends", "--json"]) == 0
    assert "numpy" in json.loads(capsys.readouterr().out)["default"]
    assert cli.main(["demo", "--backend", "no-such-backend"]) == 2


def test_main_without_typer_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "typer", None)
    assert cli.main(["backends"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "paged_sparse_attn[cli]" in err


def test_import_needs_no_cli_extra():
    code = ("import sys, paged_sparse_attn, paged_sparse_attn.cli, paged_sparse_attn.demo; "
            "assert not {'typer', 'rich', 'click', 'wgpu', 'pytest', 'hypothesis'} & set(sys.modules), "
            "sorted(sys.modules)")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------ bench, check


def _fake_module(monkeypatch, name, **attrs):
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_bench_passes_arguments_through(app, monkeypatch):
    seen = []
    _fake_module(monkeypatch, "paged_sparse_attn.bench", main=lambda argv: seen.append(argv) or 3)
    res = invoke(app, ["bench", "--json", "out.json", "--plot", "out.png", "--quick"])
    assert res.exit_code == 3
    assert seen == [["--json", "out.json", "--plot", "out.png", "--quick"]]


@pytest.mark.parametrize("extra, want", [
    ([], {}),
    (["--profile", "thorough"], {"profile": "thorough"}),
    (["--profile", "dev", "--", "-x", "-k", "R16"], {"profile": "dev", "extra_args": ["-x", "-k", "R16"]}),
])
def test_check_runs_conformance_and_exits_with_its_code(app, monkeypatch, isolated_registry, extra, want):
    calls = []

    def run_conformance(spec, **kw):
        calls.append((spec, kw))
        return 1

    _fake_module(monkeypatch, "paged_sparse_attn.testing", run_conformance=run_conformance)
    spec = "paged_sparse_attn.backends.numpy_backend:NumpyBackend"
    res = invoke(app, ["check", "--backend", spec, *extra])
    assert res.exit_code == 1, res.output
    assert calls == [(spec, want)]


def test_check_unavailable_backend_is_refused_before_the_suite_R18(app, monkeypatch, isolated_registry):
    calls = []
    _fake_module(monkeypatch, "paged_sparse_attn.testing", run_conformance=lambda spec, **kw: calls.append(spec))
    res = invoke(app, ["check", "--backend", "no_such_module:Backend"])
    assert res.exit_code == 2 and calls == []
    assert res.stderr.strip().count("\n") == 0 and "[R18]" in res.stderr


def test_check_requires_backend(app):
    res = invoke(app, ["check"])
    assert res.exit_code == 2 and "--backend" in res.output


# ----------------------------------------------------------------------- the demo problem


def test_same_seed_same_problem():
    a, b = demo.make_problem(SMALL_SIZES, seed=5), demo.make_problem(SMALL_SIZES, seed=5)
    c = demo.make_problem(SMALL_SIZES, seed=6)
    for name in ("q", "k_cache", "block_tables", "selected", "used_kv_lens", "cu_seqlens_q"):
        assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True)
    assert not np.array_equal(a.q, c.q)


def test_problem_is_paged_scrambled_with_holes_and_poison_R10():
    p = demo.make_problem(demo.DemoSizes(), seed=0)
    B = p.block_tables.shape[0]
    assert p.q.shape == (48, 8, 64) and p.k_cache.shape[1:] == (2, 16, 64) and B == 3
    assert p.queries_per_seq[0] == 1 and sum(p.queries_per_seq) == 48 and max(p.lens) == 1024
    mapped = p.block_tables[p.block_tables >= 0]
    assert len(np.unique(mapped)) == len(mapped)  # no page mapped twice
    assert not np.array_equal(mapped, np.sort(mapped))  # scrambled
    n_used = [-(-L // 16) for L in p.lens]
    holes = sum(int((p.block_tables[b, :n] < 0).sum()) for b, n in enumerate(n_used))
    assert holes == p.holes > 0
    spare = np.setdiff1d(np.arange(p.k_cache.shape[0]), mapped)
    assert spare.size and np.isnan(p.k_cache[spare]).all() and np.isnan(p.v_cache[spare]).all()
    # the mapped, used positions hold finite data; the rest of the tail page is NaN
    for b in range(B):
        for pos in (0, p.lens[b] - 1, p.lens[b]):
            page = p.block_tables[b, pos // 16] if pos < p.block_tables.shape[1] * 16 else -1
            if page >= 0:
                assert np.isfinite(p.k_cache[page, :, pos % 16]).all() == (pos < p.lens[b])


def test_sparsity_counts_match_attended_sets_R9():
    p = demo.make_problem(SMALL_SIZES, seed=2)
    S, BS = 8, 32
    attended = visible = 0
    for b in range(len(p.lens)):
        lo, hi = p.cu_seqlens_q[b], p.cu_seqlens_q[b + 1]
        L, T = p.lens[b], hi - lo
        for t in range(lo, hi):
            i = t - lo
            seen = [x for x in range(0, max(0, min(L, L - T + i + 1))) if p.block_tables[b, x // S] >= 0]
            for h in range(p.selected.shape[1]):
                attended += len(attended_positions(p.block_tables[b], p.selected[t, h], L, T, i,
                                                   block_size=BS, page_size=S, causal=True))
                visible += len(seen)
    assert (p.attended, p.visible) == (attended, visible)
    assert 0 < p.density < 1


def test_tolerance_is_the_kits_dtype_derived_one_R20():
    from paged_sparse_attn.testing import tolerance

    assert demo.tolerance(np.float32) == tolerance("float32").out
    assert demo.tolerance(np.float16) == tolerance("float16").out > demo.tolerance(np.float32)


def test_run_demo_reports_unsupported_discovered_backend(isolated_registry):
    class F32Only(NumpyBackend):
        name = "f32-only"

        @property
        def capabilities(self):
            return psa.Capabilities(dtypes=("float32",))

    # discovery limited to numpy and this backend: the test is about the demo, not about wgpu
    with isolated_registry.registry_scope(builtins=("numpy",)):
        psa.register_backend("f32-only", F32Only)
        sizes = demo.DemoSizes(**{**SMALL_SIZES.__dict__, "dtype": "float16"})
        rep = demo.run_demo(sizes, repeat=0)
        status = {r.name: r.status for r in rep.results}
        assert status["f32-only"] == "unsupported" and rep.ok  # found by discovery: not a failure
        rep = demo.run_demo(sizes, backends=["f32-only"], repeat=0)
        assert rep.results[0].status == "error" and not rep.ok  # asked for by name: must run it
