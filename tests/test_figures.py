"""The documentation figures stay legible at the docs' width (scripts/make_figures.py).

Checks what the generator measures (the smallest text of every figure, in px once scaled to the
docs' text column) without comparing file bytes, which depend on the matplotlib version.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def make_figures():
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_figure_is_generated_and_referenced(make_figures):
    pages = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md"))
    for name in make_figures.FIGURES:
        assert (ROOT / "docs" / "figures" / name).is_file(), name
        assert f"figures/{name}" in pages, f"{name} is generated but no page shows it"


@pytest.mark.parametrize("name", ["paged-layout.svg", "kv-outer.svg", "causal.svg", "bench-h200-decode.png",
                                  "bench-h200-prefill.png", "bench-h200-sweeps.png", "bench-cpu.png"])
def test_figure_text_is_at_least_12_px_at_the_docs_width(make_figures, name):
    import matplotlib.pyplot as plt

    fig = make_figures.FIGURES[name]()
    try:
        px, text = make_figures.smallest_text_px(fig, name.rsplit(".", 1)[1])
    finally:
        plt.close(fig)
    assert px >= make_figures.MIN_TEXT_PX, f"{name}: {text!r} is {px:.1f} px"
