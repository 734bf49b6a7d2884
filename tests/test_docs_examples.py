"""Every ```python block of README.md and docs/**/*.md runs.

A page's blocks run in order in one namespace (later blocks may use earlier names), in a
temporary working directory. A block opts out only with a ``<!-- no-test -->`` line right
before its fence (blank lines between are allowed). Blocks fenced as ``py`` (e.g. snippets
quoted from the source) are not examples and are not collected.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
OPT_OUT = "<!-- no-test -->"
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
def test_page_examples_run(page, isolated):
    ns: dict = {"__name__": "__main__"}
    for line, code, opted_out in extract_blocks(page.read_text(encoding="utf-8")):
        if opted_out:
            continue
        # pad so that tracebacks point at the markdown line
        compiled = compile("\n" * (line - 1) + code, str(page), "exec")
        exec(compiled, ns)


def test_docs_have_runnable_examples():
    # guards the collector: an empty parameter list would make the test above vanish silently
    assert PAGES, f"no ```python examples found under {ROOT}"


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
