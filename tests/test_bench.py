"""Smoke tests of the benchmark harness: it runs and reports sane, measured numbers.

No timing is asserted: only that every reported quantity is present, finite and consistent.
"""

import json
import math

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn import bench
from paged_sparse_attn.bench.workloads import Workload, make_problem, needed_kv_bytes


def test_needed_kv_bytes_counts_each_selected_block_once():
    w = Workload("t", B=2, L=300, Tq_per_seq=3, Hq=4, Hkv=2, D=8, page_size=4, block_size=16, topk=3,
                 dtype="float16")
    p = make_problem(w, seed=1)
    sel, cu = p["selected"], p["cu_seqlens_q"]
    b = np.repeat(np.arange(2), np.diff(cu))
    blocks = {(int(b[t]), h, int(s)) for t, h, s in zip(*np.nonzero(sel >= 0)) for s in [sel[t, h, s]]}
    tokens = sum(min(16, 300 - s * 16) for _, _, s in blocks)
    assert needed_kv_bytes(p) == tokens * 8 * 2 * 2


def test_make_problem_selects_the_local_block_and_nothing_in_the_future():
    w = Workload("t", B=2, L=200, Tq_per_seq=5, Hq=4, Hkv=2, D=8, page_size=4, block_size=16, topk=4)
    p = make_problem(w, seed=2, fill="selected")
    idx = psa.build_kvouter_index(p["selected"], p["block_tables"], p["cu_seqlens_q"], p["used_kv_lens"],
                                  block_size=16, page_size=4, causal=True)
    kept = np.diff(idx.row_ptr).reshape(10, 2)
    assert (kept == (p["selected"] >= 0).sum(-1)).all()  # every selected block is visible
    for t in range(10):
        local = (200 - 5 + t % 5) // 16
        assert (p["selected"][t] == local).any(axis=-1).all()
    out, ref = psa.forward(**p), psa.dense_reference(**p)[0]
    assert np.abs(out - ref).max() < 1e-4


def test_cpu_suite_quick_reports_ratios(tmp_path):
    path = tmp_path / "cpu.json"
    assert bench.main(["--suite", "cpu", "--quick", "--json", str(path), "--plot", str(tmp_path / "cpu.png")]) == 0
    res = json.loads(path.read_text())
    assert res["matmul_gflops"] > 0
    for row in res["rows"]:
        for key in ("forward_s", "gather_floor_s", "forward_over_gather", "forward_gflops", "index_share"):
            assert math.isfinite(row[key]) and row[key] > 0, key
    assert (tmp_path / "cpu.png").stat().st_size > 1000


def test_gpu_suite_quick_runs_on_the_wgpu_backend(tmp_path):
    path = tmp_path / "gpu.json"
    assert bench.main(["--suite", "gpu", "--quick", "--backend", "wgpu", "--repeat", "1",
                       "--json", str(path), "--plot", str(tmp_path / "gpu.png")]) == 0
    res = json.loads(path.read_text())
    assert res["backends"] == ["wgpu"]
    assert res["copy_bandwidth"] > 0
    for row in res["rows"]:
        assert row["wgpu_s"] > 0 and row["wgpu_e2e_s"] > 0
        assert math.isfinite(row["wgpu_floor_ratio"]) and row["wgpu_floor_ratio"] > 0
    assert (tmp_path / "gpu.png").stat().st_size > 1000
    for row in res["rows"]:  # the call's kernels as forward() encodes them, one timed pass each
        assert row["wgpu_call_s"] > 0
        assert math.isfinite(row["wgpu_call_floor_ratio"]) and row["wgpu_call_floor_ratio"] > 0


def test_gpu_suite_runs_only_the_workloads_named(tmp_path):
    path = tmp_path / "gpu.json"
    assert bench.main(["--suite", "gpu", "--quick", "--backend", "wgpu", "--repeat", "1",
                       "--workload", "decode-quick", "--json", str(path)]) == 0
    assert [r["workload"] for r in json.loads(path.read_text())["rows"]] == ["decode-quick"]
    with pytest.raises(ValueError, match="unknown workload.*decode-quick"):
        bench.run("gpu", quick=True, backends=["wgpu"], repeat=1, workloads=["decode-fast"])
    with pytest.raises(SystemExit):
        bench.main(["--suite", "cpu", "--workload", "decode-quick"])


def test_index_suite_quick_runs_every_backend(tmp_path):
    path = tmp_path / "index.json"
    assert bench.main(["--suite", "index", "--quick", "--repeat", "1", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    (row,) = res["rows"]
    assert row["numpy_s"] > 0 and row["wgpu_s"] > 0


def test_layer_suite_quick_times_the_plan_loops(tmp_path):
    """The layer suite's code path on the wgpu backend (lavapipe in CI): every loop is timed and
    the pass split of a call comes from timestamps where the device has them."""
    path = tmp_path / "layer.json"
    assert bench.main(["--suite", "layer", "--quick", "--backend", "wgpu", "--repeat", "1", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    (row,) = [r for r in res["rows"] if r["impl"] == "wgpu"]
    for k in ("attention_s", "attention_synced_s", "layer_s", "layer_synced_s", "forward_numpy_s"):
        assert row[k] > 0, (k, row)
    for loop in ("attention", "layer"):  # the host's part of a pipelined loop: up to its wall time
        assert 0 < row[f"{loop}_host_s"] <= row[f"{loop}_s"], (loop, row)
    assert row["kernel"] == "decode"
