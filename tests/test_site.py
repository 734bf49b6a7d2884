"""The built documentation site: it reads offline and the API reference renders cleanly.

The site is built once per test session (``mkdocs build --strict``, a few seconds) into a
temporary folder; every test here inspects that build.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A reference that makes a browser fetch something: the value is a URL with a host of its own.
_EXTERNAL = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.I)
# @import / url(...) in a stylesheet or a style attribute, and a script's own loads.
_CSS_LOAD = re.compile(r"""(?:@import\s+(?:url\(\s*)?|url\(\s*)["']?\s*((?:https?:)?//[^"')\s;]+)""", re.I)
_RAW_ROLE = re.compile(r":(?:attr|meth|func|class|mod|data|exc|obj|ref|py:\w+):")


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


class _Loads(HTMLParser):
    """Every URL an HTML page makes the browser load (not the ones a reader may follow)."""

    # (tag, attribute) pairs whose URL is fetched when the page is shown
    _FETCHED = {("script", "src"), ("img", "src"), ("img", "srcset"), ("source", "src"),
                ("source", "srcset"), ("iframe", "src"), ("embed", "src"), ("object", "data"),
                ("video", "src"), ("video", "poster"), ("audio", "src"), ("input", "src"),
                ("image", "href"), ("use", "href")}
    # <link rel=...> that only names an address and fetches nothing
    _NOT_FETCHED_REL = {"canonical", "alternate", "author", "license", "help", "next", "prev", "search"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.loads: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "link":
            rels = set(a.get("rel", "").lower().split())
            if not rels or rels - self._NOT_FETCHED_REL:
                self.loads.append(a.get("href", ""))
        for (t, attr) in self._FETCHED:
            if t == tag and attr in a:
                self.loads.extend(u.split()[0] for u in a[attr].split(",") if u.strip())
        if "style" in a:
            self.loads.extend(_CSS_LOAD.findall(a["style"]))
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.loads.extend(_CSS_LOAD.findall(data))


def _external_loads(site: Path) -> list[str]:
    found = []
    for path in sorted(site.rglob("*")):
        if path.suffix == ".html":
            parser = _Loads()
            parser.feed(path.read_text(encoding="utf-8"))
            found += [f"{path.relative_to(site)}: {u}" for u in parser.loads if _EXTERNAL.match(u)]
        elif path.suffix in (".css", ".js"):
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path.relative_to(site)}: {u}" for u in _CSS_LOAD.findall(text)]
    return found


def test_no_page_loads_anything_from_another_host(site):
    # An offline reader must not wait on a font, script or stylesheet server (plain <a href>
    # hyperlinks are fine: they are followed only when clicked).
    assert (site / "index.html").is_file()
    assert _external_loads(site) == []


def test_the_external_load_check_can_fail(tmp_path):
    # guards the check above: each kind of external load is reported
    (tmp_path / "a.html").write_text(
        '<link rel="stylesheet" href="https://fonts.example.org/css">'
        '<link rel="canonical" href="https://docs.example.org/">'
        '<a href="https://example.org/">a plain hyperlink</a>'
        '<script src="//cdn.example.org/x.js"></script>'
        '<style>@import url("https://example.org/a.css");</style>', encoding="utf-8")
    (tmp_path / "b.css").write_text("p { background: url(https://example.org/b.png) }", encoding="utf-8")
    got = _external_loads(tmp_path)
    assert [g.split(": ", 1)[1] for g in got] == [
        "https://fonts.example.org/css", "//cdn.example.org/x.js", "https://example.org/a.css",
        "https://example.org/b.png"]


def test_api_reference_has_no_raw_sphinx_role(site):
    # Docstrings are rendered as NumPy-style markdown: a Sphinx role would print as text.
    text = (site / "api" / "index.html").read_text(encoding="utf-8")
    roles = sorted({text[max(m.start() - 40, 0):m.end() + 40] for m in _RAW_ROLE.finditer(text)})
    assert roles == []


def test_api_reference_documents_the_backend_records_and_index_methods(site):
    text = (site / "api" / "index.html").read_text(encoding="utf-8")
    for anchor in ("paged_sparse_attn.Problem", "paged_sparse_attn.index_branch.IndexProblem",
                   "paged_sparse_attn.index_branch.TopkProblem", "paged_sparse_attn.Backend.block_scores",
                   "paged_sparse_attn.Backend.select_topk"):
        assert f'id="{anchor}"' in text, anchor


def test_search_splits_qualified_names(site):
    # `psa.lse_from_base2` on a page is found by `lse_from_base2`: the search index splits both
    # the page and the query with the same separator.
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    sep = re.compile(index["config"]["separator"])
    assert [t for t in sep.split("psa.lse_from_base2(x)") if t] == ["psa", "lse", "from", "base2", "x"]
    assert [t for t in sep.split("lse_from_base2") if t] == ["lse", "from", "base2"]
    assert [t for t in sep.split("version 2.4x") if t] == ["version", "2.4x"]  # numbers stay whole
    pages = [d for d in index["docs"] if "psa.lse_from_base2" in d["text"]]
    assert pages, "no page writes psa.lse_from_base2 any more: pick another example"


def test_404_page_stands_alone(site):
    # It is served at any depth and opened from local copies: it must load nothing by path.
    parser = _Loads()
    parser.feed((site / "404.html").read_text(encoding="utf-8"))
    assert parser.loads == []
