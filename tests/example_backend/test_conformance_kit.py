"""The conformance kit on a third-party backend: it passes a correct one and fails a broken one.

Each test runs pytest in a fresh process, exactly as a backend author would, from an empty
directory, with the example backend importable as ``example_backend.loop_backend``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import paged_sparse_attn
from paged_sparse_attn.testing.conformance import plugin_args

TESTS_DIR = Path(__file__).resolve().parents[1]  # holds the example_backend package
LOOP = "example_backend.loop_backend:LoopBackend"
BROKEN = "example_backend.loop_backend:CausalBlindLoopBackend"
UNAVAILABLE = "example_backend.loop_backend:UnavailableBackend"


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's backend options must not leak into the kit's runs
    pkg_root = str(Path(paged_sparse_attn.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), pkg_root, env.get("PYTHONPATH")) if p)
    env.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())  # lavapipe warns without it
    return env


def _python(code: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _pytest(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "paged_sparse_attn.testing", "-p", "no:cacheprovider",
           *plugin_args(), *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


def test_run_conformance_passes_the_loop_backend(tmp_path):
    proc = _python(f"import sys; from paged_sparse_attn.testing import run_conformance; "
                   f"sys.exit(run_conformance({LOOP!r}, profile='ci'))", tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert " passed" in proc.stdout and " failed" not in proc.stdout, _tail(proc)


def test_run_conformance_fails_a_backend_that_ignores_causal(tmp_path):
    proc = _python(f"import sys; from paged_sparse_attn.testing import run_conformance; "
                   f"sys.exit(run_conformance({BROKEN!r}, profile='ci', extra_args=['-x']))", tmp_path)
    assert proc.returncode == 1, _tail(proc)
    assert "FAILED" in proc.stdout and "test_R" in proc.stdout, _tail(proc)


def test_the_suite_fails_every_mutant_and_passes_its_correct_base(tmp_path):
    from example_backend.mutants import MUTANTS

    specs = [f"example_backend.mutants:{name}" for name in ("Correct", *MUTANTS)]
    args = [a for spec in specs for a in ("--backend", spec)]
    proc = _pytest(*args, "-k", "R11_forward or R12 or R20", "-p", "example_backend.hunt_profile",
                   "--hypothesis-profile", "hunt", "-q", "-rf", "-p", "no:warnings", cwd=tmp_path, timeout=600)
    failed = {line.split("[", 1)[1].split("]", 1)[0] for line in proc.stdout.splitlines()
              if line.startswith("FAILED") and "[" in line}
    assert not {s for s in failed if s.endswith(":Correct")}, _tail(proc)
    missed = [s for s in specs[1:] if s not in failed]
    assert not missed, f"the suite did not catch {missed}\n{_tail(proc)}"


def test_the_kit_fails_every_contract_mutant_in_the_test_of_its_rule(tmp_path):
    from example_backend.mutants import CONTRACT_MUTANTS

    specs = {f"example_backend.mutants:{name}": expr for name, expr in CONTRACT_MUTANTS.items()}
    args = [a for spec in ["example_backend.mutants:Correct", *specs] for a in ("--backend", spec)]
    every = " or ".join(dict.fromkeys(e for expr in specs.values() for e in expr.split(" or ")))
    proc = _pytest(*args, "-k", every, "-p", "example_backend.hunt_profile", "--hypothesis-profile", "hunt",
                   "-q", "-rf", "-p", "no:warnings", cwd=tmp_path, timeout=600)
    # "FAILED file::test[param]", followed by " - message" in some terminals (always under CI)
    failed = [line.split("::", 1)[1].split(" - ", 1)[0] for line in proc.stdout.splitlines()
              if line.startswith("FAILED")]
    assert not [f for f in failed if ":Correct]" in f], _tail(proc)
    for spec, expr in specs.items():
        caught = [f for f in failed if f.endswith(f"[{spec}]") and any(k in f for k in expr.split(" or "))]
        assert caught, f"no test of {expr} failed {spec}\n{_tail(proc)}"


def test_a_factory_whose_backend_probes_unavailable_is_skipped_not_run(tmp_path):
    spec = "example_backend.loop_backend:make_unavailable"
    proc = _pytest("--backend", spec, "-k", "R18", "-rs", cwd=tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert "needs a device this machine does not have" in proc.stdout and " passed" not in proc.stdout, _tail(proc)
    assert f"  {spec}: unavailable" in proc.stdout, _tail(proc)


def test_required_backend_that_is_unavailable_is_an_error_not_a_skip(tmp_path):
    proc = _pytest("--require-backend", UNAVAILABLE, "-k", "R18 and UnavailableBackend", "-rsE", cwd=tmp_path)
    assert proc.returncode == 1, _tail(proc)
    assert "required (--require-backend) but unavailable" in proc.stdout, _tail(proc)
    assert "needs a device this machine does not have" in proc.stdout, _tail(proc)
    assert "4 errors" in proc.stdout and " passed" not in proc.stdout and "skipped" not in proc.stdout, _tail(proc)


def test_required_backend_fails_the_run_even_if_no_selected_test_uses_it(tmp_path):
    proc = _pytest("--backend", "numpy", "--require-backend", UNAVAILABLE, "-k", "R18 and numpy", cwd=tmp_path)
    assert proc.returncode == 1, _tail(proc)
    assert f"required backend {UNAVAILABLE!r} is unavailable" in proc.stdout, _tail(proc)


def test_unavailable_backend_that_is_not_required_is_skipped_with_the_reason(tmp_path):
    proc = _pytest("--backend", UNAVAILABLE, "-k", "R18", "-rs", cwd=tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert "SKIPPED" in proc.stdout and "needs a device this machine does not have" in proc.stdout, _tail(proc)
    assert " passed" not in proc.stdout, _tail(proc)


def test_backend_option_selects_and_the_header_lists_availability(tmp_path):
    proc = _pytest("--backend", LOOP, "--co", cwd=tmp_path)
    assert proc.returncode == 0, _tail(proc)
    items = [line.strip() for line in proc.stdout.splitlines() if "<Function test_" in line]
    assert items and all(f"[{LOOP}" in i for i in items), _tail(proc)  # only the selected backend
    assert "paged_sparse_attn backends:" in proc.stdout, _tail(proc)
    assert "  numpy: available" in proc.stdout, _tail(proc)
    assert f"  {LOOP}: available [selected]" in proc.stdout, _tail(proc)
