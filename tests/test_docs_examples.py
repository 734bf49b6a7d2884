"""Every ```python block of README.md and docs/**/*.md runs.

A page's blocks run in order in one namespace (later blocks may use earlier names), in a
temporary working directory. A block opts out only with a ``<!-- no-test -->`` line right
before its fence (blank lines between are allowed). Blocks fenced as ``py`` (e.g. snippets
quoted from the source) are not examples and are not collected.

A page whose examples need an optional backend says so with a ``<!-- requires-backend: NAME -->``
line. Where that backend's probe reports it unavailable, the page is skipped with the probe's
reason (or fails, when the run was given ``--require-backend NAME``); where it is available the
page always runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
OPT_OUT = "<!-- no-test -->"
_REQUIRES = re.compile(r"^<!-- requires-backend: (?P<name>[\w.-]+) -->[ \t]*$", re.M)
# examples that construct a backend class directly: `from paged_sparse_attn.backends.NAME import`
_BACKEND_IMPORT = re.compile(r"\bpaged_sparse_attn\.backends\.(?P<name>\w+)\b")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\n]*)$")


def extract_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(first code line number (1-based), code, opted_out)`` of every ```python block.

    Fences may be indented (admonitions, tabs, lists): the fence's indentation is removed from
    each line of the block. The closing fence is the same character, at least as long.
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        lang = re.split(r"[\s{]", info, maxsplit=1)[0].lstrip(".") if info else ""
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if lang == "python":
            body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            opted_out = k >= 0 and lines[k].strip() == OPT_OUT
            blocks.append((i + 2, "\n".join(body) + "\n", opted_out))
        i = j + 1
    return blocks


def doc_pages() -> list[Path]:
    pages = [ROOT / "README.md"] if (ROOT / "README.md").is_file() else []
    pages += sorted((ROOT / "docs").rglob("*.md")) if (ROOT / "docs").is_dir() else []
    return [p for p in pages if any(not out for _, _, out in extract_blocks(p.read_text(encoding="utf-8")))]


PAGES = doc_pages()


def required_backends(text: str) -> list[str]:
    """The backends a page declares with ``<!-- requires-backend: NAME -->`` lines, in order."""
    return list(dict.fromkeys(m["name"] for m in _REQUIRES.finditer(text)))


def gate_on_backends(text: str, required_by_run: list[str]) -> None:
    """Skip (or fail) before running a page whose declared backends are not all available.

    Uses each backend's probe (through ``list_backends()``, which never raises): a page is skipped
    only when a probe says no, with that probe's reason; a backend the run requires
    (``--require-backend``) fails instead, like every other test on it.
    """
    from paged_sparse_attn import list_backends

    needed = required_backends(text)
    if not needed:
        return
    avail = list_backends()
    for name in needed:
        a = avail.get(name)
        reason = "not registered" if a is None else a.reason
        if a is not None and a.ok:
            continue
        if name in required_by_run:
            pytest.fail(f"backend {name!r} is required (--require-backend) but unavailable: {reason}",
                        pytrace=False)
        pytest.skip(f"backend {name!r} is unavailable: {reason}")


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Run in a temp dir with a headless matplotlib; undo registry and numpy print changes."""
    from paged_sparse_attn import registry

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    opts = np.get_printoptions()
    with registry.registry_scope():
        yield
    np.set_printoptions(**opts)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_examples_run(page, isolated, request):
    text = page.read_text(encoding="utf-8")
    gate_on_backends(text, request.config.getoption("psa_required", []))
    ns: dict = {"__name__": "__main__"}
    for line, code, opted_out in extract_blocks(text):
        if opted_out:
            continue
        # pad so that tracebacks point at the markdown line
        compiled = compile("\n" * (line - 1) + code, str(page), "exec")
        exec(compiled, ns)


def test_docs_have_runnable_examples():
    # guards the collector: an empty parameter list would make the test above vanish silently
    assert PAGES, f"no ```python examples found under {ROOT}"


def test_pages_declare_the_backends_their_examples_construct():
    # a page that imports a backend module must declare it, or it fails where that backend is absent
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        used = {m["name"] for _, code, out in extract_blocks(text) if not out
                for m in _BACKEND_IMPORT.finditer(code)} - {"base", "numpy_backend"}  # always there
        missing = used - set(required_backends(text))
        assert not missing, f"{page.relative_to(ROOT)}: add <!-- requires-backend: NAME --> for {sorted(missing)}"


_WGPU_PAGE = ROOT / "docs" / "backends" / "wgpu.md"


def _probe_says(monkeypatch, ok: bool, reason: str) -> None:
    from paged_sparse_attn import Availability
    from paged_sparse_attn.backends.wgpu import WgpuBackend

    monkeypatch.setattr(WgpuBackend, "probe", classmethod(lambda cls: Availability(ok, reason)))


def test_wgpu_page_is_skipped_with_the_probe_reason_where_wgpu_is_unavailable(monkeypatch, isolated):
    text = _WGPU_PAGE.read_text(encoding="utf-8")
    assert required_backends(text) == ["wgpu"]
    _probe_says(monkeypatch, False, "wgpu is not installed (simulated)")
    with pytest.raises(pytest.skip.Exception, match=r"'wgpu' is unavailable: wgpu is not installed \(simulated\)"):
        gate_on_backends(text, required_by_run=[])
    # a run that requires wgpu reports the page as failed, not skipped
    with pytest.raises(pytest.fail.Exception, match=r"required .* not installed \(simulated\)"):
        gate_on_backends(text, required_by_run=["wgpu"])


def test_wgpu_page_is_never_skipped_where_wgpu_is_available(monkeypatch, isolated):
    _probe_says(monkeypatch, True, "ok: simulated adapter")
    gate_on_backends(_WGPU_PAGE.read_text(encoding="utf-8"), required_by_run=[])  # no skip, no fail


def test_extract_blocks_rules():
    text = "\n".join([
        "# Title",
        "```python",
        "a = 1",
        "```",
        "<!-- no-test -->",
        "",
        "```python",
        "raise SystemExit",
        "```",
        "```py",
        '--8<-- "src/x.py:part"',
        "```",
        "!!! example",
        "",
        "    ```python title=\"b.py\"",
        "    b = a + 1",
        "    if b:",
        "        c = b",
        "    ```",
        "````markdown",
        "```python",
        "not collected: inside a 4-backtick fence",
        "```",
        "````",
        "~~~python",
        "d = 4",
        "~~~",
    ])
    got = extract_blocks(text)
    assert [(ln, out) for ln, _, out in got] == [(3, False), (8, True), (16, False), (26, False)]
    assert got[0][1] == "a = 1\n"
    assert got[2][1] == "b = a + 1\nif b:\n    c = b\n"
    assert got[3][1] == "d = 4\n"


def test_a_failing_block_fails_with_the_page_line(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\nassert x == 2\n```\n", encoding="utf-8")
    (line, code, _), = extract_blocks(page.read_text())
    with pytest.raises(AssertionError) as ei:
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), {})
    assert ei.traceback[-1].lineno + 1 == 5  # pytest's lineno is 0-based
