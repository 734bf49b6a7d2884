"""Plugins through the entry point group `paged_sparse_attn.backends`, and `use_backend`.

The plugin tests install nothing: they write a throwaway distribution (a ``*.dist-info`` with an
``entry_points.txt``, plus its modules) to a temporary directory on ``sys.path`` — exactly what
``importlib.metadata`` finds for an installed package — and make the registry read it afresh.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import paged_sparse_attn as psa
from paged_sparse_attn import registry
from paged_sparse_attn.backends.numpy_backend import NumpyBackend

SRC = str(Path(psa.__file__).resolve().parents[1])
DOCS = Path(__file__).resolve().parents[1] / "docs"

PLUGIN_MODULES = {
    "psa_testplug_good": '''
        from paged_sparse_attn import Availability
        from paged_sparse_attn.backends.numpy_backend import NumpyBackend

        class GoodBackend(NumpyBackend):
            name = "good-plugin"
            calls = 0

            @classmethod
            def probe(cls):
                return Availability(True, "ok: the good plugin")

            def forward_partials(self, problem, index):
                type(self).calls += 1
                return super().forward_partials(problem, index)
    ''',
    "psa_testplug_import_error": '''
        raise RuntimeError("boom while importing the plugin")
    ''',
    "psa_testplug_factory_error": '''
        def make():
            raise RuntimeError("no device for the plugin here")
    ''',
}

ENTRY_POINTS = """\
[paged_sparse_attn.backends]
good-plugin = psa_testplug_good:GoodBackend
import-error-plugin = psa_testplug_import_error:Backend
factory-error-plugin = psa_testplug_factory_error:make
numpy = psa_testplug_good:GoodBackend
"""


def write_distribution(root: Path) -> Path:
    """A distribution `psa-testplug` as pip would leave it in site-packages."""
    for name, code in PLUGIN_MODULES.items():
        (root / f"{name}.py").write_text(textwrap.dedent(code))
    info = root / "psa_testplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: psa-testplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


@pytest.fixture
def isolated_registry():
    """Registrations made in a test disappear after it."""
    with registry.registry_scope():
        yield registry


@pytest.fixture
def plugins(tmp_path, monkeypatch, isolated_registry):
    """The throwaway distribution on sys.path, and a registry that reads the entry points afresh."""
    root = write_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(root))  # also invalidates the import caches
    for name in PLUGIN_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    psa.refresh_backends()
    yield root
    for name in PLUGIN_MODULES:
        sys.modules.pop(name, None)


def small_problem(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((5, 4, 8)).astype(dtype)
    k = rng.standard_normal((6, 2, 4, 8)).astype(dtype)
    v = rng.standard_normal((6, 2, 4, 8)).astype(dtype)
    block_tables = np.array([[4, 1, -1, 0], [2, 5, 3, -1]], dtype=np.int32)
    selected = np.array([[[0, 1], [1, -1]], [[1, 0], [0, -1]], [[0, -1], [1, 0]],
                         [[1, -1], [0, 1]], [[0, 1], [-1, -1]]], dtype=np.int32)
    cu = np.array([0, 2, 5], dtype=np.int32)
    return (q, k, v, block_tables, selected, cu), dict(block_size=8, used_kv_lens=np.array([15, 12]), causal=True)


# ---------------------------------------------------------------------------- entry points


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_list_backends_shows_plugins_and_why_broken_ones_fail_R18(plugins):
    found = psa.list_backends()
    assert {"numpy", "good-plugin", "import-error-plugin", "factory-error-plugin"} <= set(found)
    assert found["good-plugin"] == psa.Availability(True, "ok: the good plugin")
    bad_import = found["import-error-plugin"]
    assert not bad_import.ok and "boom while importing the plugin" in bad_import.reason
    bad_factory = found["factory-error-plugin"]
    assert not bad_factory.ok and "no device for the plugin here" in bad_factory.reason


def test_plugins_are_imported_lazily(plugins):
    assert not any(m.startswith("psa_testplug") for m in sys.modules)
    with pytest.warns(RuntimeWarning):  # the shadowing plugin (built-ins win)
        psa.register_backend("t-lazy", NumpyBackend)  # reads the entry points, imports none
    assert not any(m.startswith("psa_testplug") for m in sys.modules)
    assert psa.get_backend("good-plugin").name == "good-plugin"
    assert "psa_testplug_good" in sys.modules and "psa_testplug_import_error" not in sys.modules


@pytest.mark.filterwarnings("ignore:.*could not be imported:RuntimeWarning")
def test_plugin_named_like_a_builtin_is_dropped_with_a_warning(plugins):
    with pytest.warns(RuntimeWarning, match=r"plugin backend 'numpy' \(psa_testplug_good:GoodBackend.*built-in"):
        names = list(psa.list_backends())
    assert type(psa.get_backend("numpy")) is NumpyBackend
    assert names.count("numpy") == 1


@pytest.mark.filterwarnings("ignore:.*built-in backend has that name:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:.*could not be imported:RuntimeWarning")
def test_two_plugins_of_one_name_keep_one_with_a_warning(plugins):
    info = plugins / "psa_testplug_twin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: psa-testplug-twin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[paged_sparse_attn.backends]\ngood-plugin = psa_testplug_good:GoodBackend\n")
    psa.refresh_backends()
    with pytest.warns(RuntimeWarning, match="several plugins declare the backend 'good-plugin'"):
        names = list(psa.list_backends())
    assert names.count("good-plugin") == 1
    assert psa.get_backend("good-plugin").name == "good-plugin"


@pytest.mark.filterwarnings("ignore:.*built-in backend has that name:RuntimeWarning")
def test_listing_order_is_builtins_then_plugins_by_name_then_runtime(plugins):
    psa.register_backend("a-runtime", NumpyBackend)
    with pytest.warns(RuntimeWarning, match="import-error-plugin"):
        names = list(psa.list_backends())
    assert names == ["numpy", "wgpu", "dawn", "factory-error-plugin", "good-plugin", "import-error-plugin", "a-runtime"]


@pytest.mark.filterwarnings("ignore:.*built-in backend has that name:RuntimeWarning")
def test_plugin_that_fails_to_import_warns_once_and_is_listed_unavailable_R18(plugins):
    with pytest.warns(RuntimeWarning, match="'import-error-plugin'.*boom while importing") as rec:
        first = psa.list_backends()["import-error-plugin"]
    assert sum("import-error-plugin" in str(w.message) for w in rec) == 1
    assert not first.ok and "boom while importing the plugin" in first.reason
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure is remembered: no second import, no second warning
        assert psa.list_backends()["import-error-plugin"] == first


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_refresh_backends_reads_a_fixed_plugin_again(plugins):
    assert not psa.list_backends()["import-error-plugin"].ok
    (plugins / "psa_testplug_import_error.py").write_text(
        "from psa_testplug_good import GoodBackend as Backend\n")
    sys.modules.pop("psa_testplug_import_error", None)
    assert not psa.list_backends()["import-error-plugin"].ok  # remembered until a refresh
    psa.refresh_backends()
    assert psa.list_backends()["import-error-plugin"].ok


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_good_plugin_runs_forward(plugins):
    args, kw = small_problem()
    out = psa.forward(*args, **kw, backend="good-plugin")
    cls = type(psa.get_backend("good-plugin"))
    assert cls.__module__ == "psa_testplug_good" and cls.calls == 1
    ref, _ = psa.dense_reference(*args, **kw)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_array_equal(out, psa.forward(*args, **kw, backend="numpy"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name, why", [("import-error-plugin", "boom while importing the plugin"),
                                       ("factory-error-plugin", "no device for the plugin here")])
def test_broken_plugin_is_unavailable_with_reason_R18(plugins, name, why):
    with pytest.raises(psa.BackendUnavailableError, match=why) as info:
        psa.get_backend(name)
    assert "[R18]" in str(info.value)
    args, kw = small_problem()
    with pytest.raises(psa.BackendUnavailableError, match=why):
        psa.forward(*args, **kw, backend=name)
    assert psa.forward(*args, **kw).shape == (5, 4, 8)  # the other backends are unaffected


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cli_backends_lists_plugins(plugins):
    typer_testing = pytest.importorskip("typer.testing")
    from paged_sparse_attn import cli

    res = typer_testing.CliRunner().invoke(cli.build_app(), ["backends", "--json"])
    assert res.exit_code == 0, res.output
    rows = {b["name"]: b for b in json.loads(res.stdout)["backends"]}
    assert rows["good-plugin"]["available"] and rows["good-plugin"]["capabilities"]["dtypes"]
    assert not rows["import-error-plugin"]["available"]
    assert "boom while importing the plugin" in rows["import-error-plugin"]["reason"]
    assert not rows["factory-error-plugin"]["available"]


def test_broken_plugin_never_breaks_import_in_a_fresh_process(tmp_path):
    root = write_distribution(tmp_path)
    code = textwrap.dedent("""
        import json, sys
        import paged_sparse_attn as psa
        assert not any(m.startswith("psa_testplug") for m in sys.modules)  # nothing read at import
        found = psa.list_backends()
        print(json.dumps({k: [v.ok, v.reason] for k, v in found.items()}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["numpy"][0] and found["good-plugin"][0]
    assert not found["import-error-plugin"][0] and "boom" in found["import-error-plugin"][1]
    assert not found["factory-error-plugin"][0]


# ------------------------------------------------------------------- probes of factories


class Unavailable(NumpyBackend):
    name = "t-unavailable"

    @classmethod
    def probe(cls):
        return psa.Availability(False, "needs a device this machine does not have")


def make_unavailable():
    """A plain factory: it has no probe of its own, the backend it builds says no."""
    return Unavailable()


@pytest.mark.parametrize("factory", [Unavailable, make_unavailable], ids=["class", "function"])
def test_R18_a_factory_whose_backend_probes_unavailable_is_listed_and_refused(isolated_registry, factory):
    psa.register_backend("t-off", factory)
    got = psa.list_backends()["t-off"]
    assert not got.ok and "needs a device" in got.reason
    with pytest.raises(psa.BackendUnavailableError, match=r"unavailable: needs a device .*\[R18\]"):
        psa.get_backend("t-off")
    args, kw = small_problem()
    with pytest.raises(psa.BackendUnavailableError, match="needs a device"):
        psa.forward(*args, **kw, backend="t-off")


def test_R18_messages_name_a_backend_by_its_name_and_its_registry_name(isolated_registry):
    class F32Only(NumpyBackend):
        name = "f32-only"

        @property
        def capabilities(self):
            return psa.Capabilities(dtypes=("float32",))

    psa.register_backend("t-registered-name", F32Only)
    args, kw = small_problem(dtype=np.float16)
    with pytest.raises(psa.UnsupportedError) as info:
        psa.forward(*args, **kw, backend="t-registered-name")
    assert "backend 'f32-only' (registered as 't-registered-name')" in str(info.value)
    with pytest.raises(psa.UnsupportedError) as info:
        psa.forward(*args, **kw, backend=F32Only())  # not built by the registry: its name alone
    assert "backend 'f32-only' cannot" in str(info.value)


def test_a_module_factory_backend_whose_probe_says_no_is_refused_R18(isolated_registry):
    spec = "example_backend.loop_backend:make_unavailable"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        assert not psa.list_backends().get(spec, psa.Availability(False, "")).ok
        with pytest.raises(psa.BackendUnavailableError, match="needs a device this machine does not have"):
            psa.get_backend(spec)
        assert spec not in psa.list_backends()  # registered only once it is known to work
    finally:
        sys.path.remove(str(Path(__file__).resolve().parent))


# ----------------------------------------------------------------------------- use_backend


class Spy(NumpyBackend):
    """Numpy, counting its calls."""

    def __init__(self, name):
        self.name = name
        self.calls = 0

    def forward_partials(self, problem, index):
        self.calls += 1
        return super().forward_partials(problem, index)


@pytest.fixture
def spies(isolated_registry):
    a, b = Spy("spy-a"), Spy("spy-b")
    psa.register_backend("spy-a", lambda: a)
    psa.register_backend("spy-b", lambda: b)
    return a, b


def test_use_backend_nests_and_restores(spies):
    a, b = spies
    default = psa.get_backend()
    args, kw = small_problem()
    with psa.use_backend("spy-a") as got_a:
        assert got_a is a and psa.get_backend() is a
        with psa.use_backend("spy-b") as got_b:
            assert got_b is b and psa.get_backend() is b
            psa.forward(*args, **kw)
            assert (a.calls, b.calls) == (0, 1)
        assert psa.get_backend() is a
        psa.forward(*args, **kw)
        assert (a.calls, b.calls) == (1, 1)
    assert psa.get_backend() is default


def test_use_backend_restores_after_an_exception(spies):
    default = psa.get_backend()
    with pytest.raises(KeyError):
        with psa.use_backend("spy-a"):
            raise KeyError("inside")
    assert psa.get_backend() is default


def test_use_backend_accepts_an_instance(spies):
    inst = Spy("unregistered")
    with psa.use_backend(inst) as got:
        assert got is inst and psa.get_backend() is inst


def test_explicit_backend_wins_over_use_backend(spies):
    a, _ = spies
    args, kw = small_problem()
    with psa.use_backend("spy-a"):
        psa.forward(*args, **kw, backend="numpy")
    assert a.calls == 0


def test_use_backend_unknown_fails_before_entering_R18(spies):
    default = psa.get_backend()
    entered = False
    with pytest.raises(psa.BackendUnavailableError, match="no-such-backend"):
        with psa.use_backend("no-such-backend"):
            entered = True
    assert not entered and psa.get_backend() is default


def test_use_backend_is_isolated_between_threads(spies):
    a, b = spies
    barrier = threading.Barrier(2, timeout=10)
    seen = {}

    def worker(name):
        with psa.use_backend(name):
            barrier.wait()  # both threads are inside their own block now
            seen[name] = psa.get_backend()
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("spy-a", "spy-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"spy-a": a, "spy-b": b}


def test_use_backend_in_one_thread_does_not_leak_to_another(spies):
    default = psa.get_backend()
    inside, release = threading.Event(), threading.Event()

    def holder():
        with psa.use_backend("spy-a"):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert inside.wait(10)
        assert psa.get_backend() is default
    finally:
        release.set()
        t.join(10)


def test_use_backend_is_isolated_between_asyncio_tasks(spies):
    a, b = spies

    async def task(name):
        with psa.use_backend(name):
            await asyncio.sleep(0)  # let the other task enter its block
            await asyncio.sleep(0)
            return psa.get_backend()

    async def both():
        return await asyncio.gather(task("spy-a"), task("spy-b"))

    assert asyncio.run(both()) == [a, b]


def test_copied_context_sees_use_backend(spies):
    a, _ = spies
    with psa.use_backend("spy-a"):
        ctx = contextvars.copy_context()
    assert psa.get_backend() is not a
    assert ctx.run(psa.get_backend) is a


# ------------------------------------------------------------------------------------ docs


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.mark.skipif(not (DOCS / "backends" / "writing-a-backend.md").exists(), reason="docs not in this tree")
def test_writing_a_backend_page_runs_and_its_backend_conforms(isolated_registry):
    from paged_sparse_attn import demo

    blocks = python_blocks(DOCS / "backends" / "writing-a-backend.md")
    assert len(blocks) >= 3
    ns: dict = {"__name__": "writing_a_backend"}
    for code in blocks:
        exec(compile(code, "writing-a-backend.md", "exec"), ns)
    # the page's backend on the demo's poisoned, paged, causal problem, float32 and float16
    for dtype in ("float32", "float16"):
        sizes = demo.DemoSizes(seqs=2, max_len=200, queries=9, q_heads=4, kv_heads=2, head_dim=16,
                               page_size=8, block_size=32, topk=3, dtype=dtype)
        rep = demo.run_demo(sizes, backends=[ns["SlotLoopBackend"]()], repeat=0)
        assert rep.ok, rep.results
