"""Generate the documentation figures into docs/figures/.

    python scripts/make_figures.py            # writes docs/figures/*.svg and the bench-*.png plots
    python scripts/make_figures.py --check    # exit 1 if a committed figure is out of date

The diagrams (SVG) are drawn from the examples of the spec pages; the benchmark plots (PNG) from
the committed results in docs/benchmarks-data/*.json, never from numbers typed here. The output
is deterministic (fixed SVG hash salt, no date or software metadata), so the figures can be
committed and re-generated without spurious diffs (PNG bytes also depend on the matplotlib and
FreeType versions). Needs matplotlib.

Sizes are chosen for the page: next to both sidebars the docs' text column is about 720 px
wide, and a wider figure is scaled down to it. Every figure's smallest text must stay at least
12 px at that width; ``main`` measures it and refuses to write a figure that falls short.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("svg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "docs" / "figures"
DATA_DIR = ROOT / "docs" / "benchmarks-data"
# The runs the benchmarks page reports (its tables quote the same files).
H200_RUN = "h200-gpu-2026-11-29-r6.json"
CPU_RUN = "cpu-2026-11-29.json"
PNG_DPI = 150
PAD_INCHES = 0.1
DISPLAY_PX = 720  # the docs' text column beside both sidebars (CSS px)
MIN_TEXT_PX = 12

plt.rcParams.update(
    {
        "svg.hashsalt": "paged_sparse_attn",
        "svg.fonttype": "path",
        "font.family": "DejaVu Sans",
        "font.size": 10,
        "figure.facecolor": "white",
        "savefig.facecolor": "white",
    }
)

# Colour palette (colour-blind safe, Okabe-Ito).
BLUE = "#0072B2"
ORANGE = "#E69F00"
GREEN = "#009E73"
RED = "#D55E00"
PURPLE = "#CC79A7"
SKY = "#56B4E9"
YELLOW = "#F0E442"
GREY = "#BBBBBB"
LIGHT = "#EEEEEE"
DARK = "#333333"
BLOCK_COLOURS = [BLUE, ORANGE, GREEN, PURPLE]


def _box(ax, x, y, w, h, fc, ec=DARK, lw=1.0, hatch=None, alpha=1.0, zorder=2):
    ax.add_patch(
        Rectangle((x, y), w, h, facecolor=fc, edgecolor=ec, linewidth=lw, hatch=hatch,
                  alpha=alpha, zorder=zorder)
    )


def _arrow(ax, xy0, xy1, color=DARK, lw=1.0, style="-|>", rad=0.0, zorder=1, ls="-"):
    ax.add_patch(
        FancyArrowPatch(xy0, xy1, arrowstyle=style, mutation_scale=9, color=color, linewidth=lw,
                        connectionstyle=f"arc3,rad={rad}", zorder=zorder, linestyle=ls,
                        shrinkA=1, shrinkB=1)
    )


def _light(colour: str, amount: float = 0.55) -> tuple[float, float, float]:
    r, g, b = matplotlib.colors.to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


# --------------------------------------------------------------------------------------------
# paged-layout.svg
# --------------------------------------------------------------------------------------------

def fig_paged_layout():
    # The example of docs/spec/cache-layout.md: one sequence, Hkv = 1 (one head row per page).
    S, BS, Hkv = 2, 4, 1  # page_size, block_size -> ppb = 2
    ppb = BS // S
    table = [7, 2, -1, 5, 0, 9, 3, -1, 4]  # max_pages = 9 -> msb = 4: page 8 is never read
    max_pages = len(table)
    msb = max_pages // ppb
    L = 13  # used_kv_len
    P = 10
    fs = 11  # smallest text; the figure is about 8.5 in wide, scaled to ~720 px: >= 12 px

    fig, ax = plt.subplots(figsize=(10.5, 6.6))
    ax.set_xlim(-4.2, 19.4)
    ax.set_ylim(-2.3, 11.2)
    ax.axis("off")

    def pos_style(p):
        """(face colour, hatch) of logical position p: the legend's four cases."""
        page = p // S
        if page >= msb * ppb:
            return "white", "xx"
        if table[page] < 0:
            return "white", "////"
        if p >= L:
            return LIGHT, ".."
        return _light(BLOCK_COLOURS[(page // ppb) % 4]), None

    cw = 1.0  # width of one logical position
    # --- logical positions -------------------------------------------------------------
    y_pos = 8.6
    ax.text(-4.1, y_pos + 0.55, "positions p\nof sequence b", va="center", ha="left", fontsize=fs)
    for p in range(max_pages * S):
        x = p * cw
        fc, hatch = pos_style(p)
        _box(ax, x, y_pos, cw, 0.8, fc, hatch=hatch, lw=0.6)
        ax.text(x + cw / 2, y_pos + 0.4, str(p), ha="center", va="center", fontsize=fs,
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none") if hatch else None)
    # page brackets
    for page in range(max_pages):
        x0 = page * S * cw
        ax.plot([x0 + 0.08, x0 + S * cw - 0.08], [y_pos - 0.15] * 2, color=DARK, lw=1.0)
        ax.text(x0 + S * cw / 2, y_pos - 0.5, f"{page}", ha="center", va="center", fontsize=fs)
    ax.text(-4.1, y_pos - 0.5, "logical page", ha="left", va="center", fontsize=fs)
    # block brackets
    for blk in range(msb):
        x0 = blk * BS * cw
        ax.plot([x0 + 0.05, x0 + BS * cw - 0.05], [y_pos + 1.05] * 2, color=BLOCK_COLOURS[blk % 4],
                lw=2.2)
        ax.text(x0 + BS * cw / 2, y_pos + 1.4, f"block s={blk}", ha="center", va="center",
                fontsize=fs + 0.5, color=BLOCK_COLOURS[blk % 4], fontweight="bold", zorder=5,
                bbox=dict(boxstyle="square,pad=0.15", fc="white", ec="none"))
    x_tail = msb * BS * cw
    ax.text(x_tail + S * cw / 2 + 0.4, y_pos + 1.5, "past msb·ppb:\nnever read", ha="center",
            va="center", fontsize=fs, color=DARK)
    # L_b cut
    ax.plot([L * cw, L * cw], [y_pos - 0.1, y_pos + 1.9], color=RED, lw=2.0, ls="--")
    ax.text(L * cw + 0.1, y_pos + 2.1, f"L_b = {L}", color=RED, fontsize=fs + 0.5, ha="center",
            fontweight="bold")

    # --- block_tables row ----------------------------------------------------------------
    y_bt = 5.6
    ax.text(-4.1, y_bt + 0.4, "block_tables[b]", va="center", ha="left", fontsize=fs,
            family="DejaVu Sans Mono")
    for page in range(max_pages):
        x = page * S * cw + 0.25
        v = table[page]
        fc = "white" if v < 0 else _light(SKY, 0.4)
        if page >= msb * ppb:
            fc = "white"
        _box(ax, x, y_bt, S * cw - 0.5, 0.8, fc, hatch="////" if v < 0 else None)
        ax.text(x + (S * cw - 0.5) / 2, y_bt + 0.4, str(v), ha="center", va="center",
                fontsize=fs + 1, fontweight="bold", family="DejaVu Sans Mono",
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none") if v < 0 else None)
        _arrow(ax, (page * S * cw + S * cw / 2, y_pos - 0.8), (page * S * cw + S * cw / 2, y_bt + 0.85),
               color=GREY, lw=0.8)

    # --- physical pages: each holds Hkv rows of S positions (here one row of two) ------------
    y_phys = 1.2
    pw = 1.7
    ph = 1.0 * Hkv
    ax.text(-4.1, y_phys + ph / 2, "k_cache\n[P, Hkv, S, D]", va="center", ha="left", fontsize=fs,
            family="DejaVu Sans Mono")
    owner = {}
    for page in range(min(max_pages, msb * ppb)):
        if table[page] >= 0:
            owner[table[page]] = page
    for j in range(P):
        x = j * pw + 0.1
        cell = (pw - 0.3) / S
        for off in range(S):
            if j in owner:  # the logical position stored in this slot, coloured like above
                p = owner[j] * S + off
                fc, hatch = pos_style(p)
                label = str(p)
            else:
                fc, hatch, label = LIGHT, None, ""
            for h in range(Hkv):
                _box(ax, x + off * cell, y_phys + h * (ph / Hkv), cell, ph / Hkv, fc, hatch=hatch, lw=0.6)
            if label:
                ax.text(x + (off + 0.5) * cell, y_phys + ph / 2, label, ha="center", va="center",
                        fontsize=fs, bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none") if hatch else None)
        _box(ax, x, y_phys, pw - 0.3, ph, "none", lw=1.2, zorder=3)
        ax.text(x + (pw - 0.3) / 2, y_phys - 0.4, f"{j}", ha="center", va="center", fontsize=fs)
    ax.text(-4.1, y_phys - 0.4, "physical page", ha="left", va="center", fontsize=fs)
    ax.text(P * pw + 0.05, y_phys + ph / 2, f"Hkv = {Hkv} row of\nS = {S} positions\n(× D each)",
            fontsize=fs, va="center", ha="left")
    for page in range(min(max_pages, msb * ppb)):
        v = table[page]
        if v < 0:
            continue
        x0 = page * S * cw + S * cw / 2
        x1 = v * pw + 0.1 + (pw - 0.3) / 2
        _arrow(ax, (x0, y_bt - 0.05), (x1, y_phys + ph + 0.05), color=BLOCK_COLOURS[(page // ppb) % 4],
               lw=1.1)

    # --- legend -----------------------------------------------------------------------------
    y_leg = -1.0
    items = [
        (_light(BLUE), None, "attendable (if selected)"),
        ("white", "////", "unmapped page (-1): skipped"),
        (LIGHT, "..", "position ≥ L_b: never read"),
        ("white", "xx", "page ≥ msb·ppb: never read"),
    ]
    for k, (fc, hatch, label) in enumerate(items):
        x, y = (k % 2) * 9.5 - 1.0, y_leg - (k // 2) * 0.7
        _box(ax, x, y, 0.6, 0.5, fc, hatch=hatch, lw=0.6)
        ax.text(x + 0.8, y + 0.25, label, va="center", fontsize=fs)
    ax.text(8.0, -2.3,
            f"S = page_size = {S},  BS = block_size = {BS},  ppb = {ppb},  max_pages = {max_pages},  "
            f"msb = {msb},  P = {P},  Hkv = {Hkv}",
            ha="center", va="center", fontsize=fs)
    return fig


# --------------------------------------------------------------------------------------------
# kv-outer.svg
# --------------------------------------------------------------------------------------------

SELECTED = {0: [0, 2], 1: [2, 0], 2: [1, 3], 3: [3, 0]}  # one sequence, one KV head, topk = 2


def fig_kv_outer():
    # One above the other, each as wide as the page, so that the text stays legible (>= 12 px).
    fs = 11
    fig, (axl, axr) = plt.subplots(2, 1, figsize=(8.0, 9.4), gridspec_kw={"height_ratios": [1.0, 1.15]})
    for ax in (axl, axr):
        ax.axis("off")

    # --- top: query-outer -------------------------------------------------------------------
    axl.set_xlim(0, 12.5)
    axl.set_ylim(-0.6, 5.2)
    axl.set_title("query-outer: each query gathers its top-k blocks", fontsize=fs + 1.5, loc="left")
    ys = {t: 4.2 - t * 1.2 for t in range(4)}
    bys = {s: 4.2 - s * 1.2 for s in range(4)}
    for t, y in ys.items():
        _box(axl, 1.5, y, 1.6, 0.7, _light(SKY, 0.3))
        axl.text(2.3, y + 0.35, f"t{t}", ha="center", va="center", fontweight="bold", fontsize=fs + 1)
    for s, y in bys.items():
        _box(axl, 8.6, y, 2.2, 0.7, _light(BLOCK_COLOURS[s]))
        axl.text(9.7, y + 0.35, f"block {s}", ha="center", va="center", fontsize=fs + 1)
    for t, blocks in SELECTED.items():
        for s in blocks:
            _arrow(axl, (3.15, ys[t] + 0.35), (8.55, bys[s] + 0.35), color=BLOCK_COLOURS[s], lw=1.3)
    axl.text(6.2, -0.45, "8 block loads for 4 queries", ha="center", fontsize=fs + 1, color=RED)

    # --- bottom: KV-outer -------------------------------------------------------------------
    axr.set_xlim(0, 12.5)
    axr.set_ylim(-0.8, 5.6)
    axr.set_title("KV-outer: each block is loaded once for the queries that chose it", fontsize=fs + 1.5,
                  loc="left")
    edges = sorted(((s, t, r) for t, bl in SELECTED.items() for r, s in enumerate(bl)))
    ey = {}
    n = len(edges)
    for e, (s, t, r) in enumerate(edges):
        y = 4.75 - e * (5.0 / n)
        ey[e] = y
    # slot groups
    groups = {}
    for e, (s, t, r) in enumerate(edges):
        groups.setdefault(s, []).append(e)
    axr.text(1.25, 5.3, "slot groups (b, s)", ha="center", fontsize=fs, style="italic")
    axr.text(5.3, 5.3, "edges → partials (o, m, l)", ha="center", fontsize=fs, style="italic")
    axr.text(10.9, 5.3, "combine (R15)", ha="center", fontsize=fs, style="italic")
    for s, es in groups.items():
        top = ey[es[0]] + 0.25
        bot = ey[es[-1]] - 0.25
        _box(axr, 0.05, bot, 2.4, top - bot, _light(BLOCK_COLOURS[s]))
        qs = ", ".join(f"t{edges[e][1]}" for e in es)
        if len(es) == 1:
            axr.text(1.25, (top + bot) / 2, f"block {s}: {qs}", ha="center", va="center",
                     fontsize=fs, fontweight="bold")
        else:
            axr.text(1.25, (top + bot) / 2 + 0.22, f"block {s}", ha="center", va="center",
                     fontsize=fs, fontweight="bold")
            axr.text(1.25, (top + bot) / 2 + 0.02, f"loaded once\nfor {qs}", ha="center",
                     va="top", fontsize=fs)
        for e in es:
            _arrow(axr, (2.5, ey[e]), (3.35, ey[e]), color=BLOCK_COLOURS[s], lw=1.0)
    for e, (s, t, r) in enumerate(edges):
        _box(axr, 3.4, ey[e] - 0.25, 3.8, 0.5, "white", ec=BLOCK_COLOURS[s])
        axr.text(5.3, ey[e], f"e{e}: t{t}, s={s}, r={r} → (o, m, l)", ha="center",
                 va="center", fontsize=fs)
    qy = {t: 4.2 - t * 1.2 for t in range(4)}
    for t, y in qy.items():
        _box(axr, 9.6, y, 2.6, 0.7, _light(SKY, 0.3))
        axr.text(10.9, y + 0.35, f"t{t}: out, lse", ha="center", va="center", fontsize=fs,
                 fontweight="bold")
    for e, (s, t, r) in enumerate(edges):
        _arrow(axr, (7.25, ey[e]), (9.55, qy[t] + 0.35), color=GREY, lw=1.0)
    axr.text(6.2, -0.55, "4 block loads for the same 8 edges;\nall G query heads of the KV head share each load",
             ha="center", va="center", fontsize=fs + 1, color=GREEN)
    fig.tight_layout(h_pad=2.0)
    return fig


# --------------------------------------------------------------------------------------------
# causal.svg
# --------------------------------------------------------------------------------------------

FS = 11  # smallest text of causal.svg: >= 12 px at the docs' width


def _causal_panel(ax, L, T, BS, title, dropped=()):
    ax.set_xlim(-2.4, max(L, 2) + 4.2)
    ax.set_ylim(-1.4, T + 1.4)
    ax.invert_yaxis()
    ax.axis("off")
    ax.set_title(title, fontsize=FS)
    for i in range(T):
        hi = L - T + i  # last visible position
        for p in range(L):
            vis = p <= hi
            blk = p // BS
            fc = _light(BLOCK_COLOURS[blk % 4], 0.25) if vis else "white"
            hatch = None if vis else "////"
            if (i, blk) in dropped:
                hatch = "xx"
            _box(ax, p, i, 1, 1, fc, hatch=hatch, lw=0.6)
            if vis:
                ax.text(p + 0.5, i + 0.5, "✓", ha="center", va="center", fontsize=FS)
        ax.text(-0.2, i + 0.5, f"i={i}", ha="right", va="center", fontsize=FS)
        txt = f"p ≤ {hi}" if hi >= 0 else f"p ≤ {hi}: none"
        ax.text(L + 0.25, i + 0.5, txt, ha="left", va="center", fontsize=FS,
                color=RED if hi < 0 else DARK)
    for p in range(L):
        ax.text(p + 0.5, -0.3, str(p), ha="center", va="center", fontsize=FS)
    for blk in range((L + BS - 1) // BS):
        x0, x1 = blk * BS, min((blk + 1) * BS, L)
        ax.plot([x0 + 0.05, x1 - 0.05], [-0.85, -0.85], color=BLOCK_COLOURS[blk % 4], lw=2.2)
        ax.text((x0 + x1) / 2, -1.15, f"block {blk}", ha="center", va="center", fontsize=FS,
                color=BLOCK_COLOURS[blk % 4], fontweight="bold")
    ax.text(-2.1, -0.3, "p →", ha="left", va="center", fontsize=FS)


def fig_causal():
    fig, (a, b) = plt.subplots(1, 2, figsize=(8.6, 4.0), gridspec_kw={"width_ratios": [1.9, 1.0]})
    _causal_panel(a, 10, 3, 4, "L_b = 10, T_b = 3, BS = 4: query i sees p ≤ L_b − T_b + i",
                  dropped={(0, 2)})
    _causal_panel(b, 2, 4, 4, "L_b = 2, T_b = 4: T_b > L_b")
    a.text(5.0, 3.55, "xx: block 2 lies entirely in the future of i=0,\nso no edge is kept (R13)",
           ha="center", va="top", fontsize=FS)
    b.text(1.0, 4.55, "i=0, 1 see nothing:\nout = 0, lse = −inf", ha="center", va="top", fontsize=FS,
           color=RED)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# bench-*.png: the benchmark results, one question per figure
# --------------------------------------------------------------------------------------------

# (JSON key prefix, label, colour); ours first, then the peers. "_e2e" is a whole forward() call.
OURS = ("wgpu", "wgpu kernels", BLUE)
OURS_CALL = ("wgpu_e2e", "wgpu forward() call", SKY)
PEERS = [
    ("torch gather+SDPA bf16", "torch gather+SDPA bf16", ORANGE),
    ("torch dense SDPA bf16", "torch dense SDPA bf16", GREEN),
    ("torch FlexAttention bf16", "torch FlexAttention bf16", PURPLE),
    ("torch dense SDPA f32", "torch dense SDPA f32", RED),
]
FLOOR = ("floor", "memory floor", GREY)


def _load(name: str) -> dict:
    return json.loads((DATA_DIR / name).read_text(encoding="utf-8"))


def _rows(run: dict) -> dict:
    return {r["workload"]: r for r in run["rows"]}


def _fmt_us(us: float) -> str:
    if us >= 1000:
        return f"{us / 1000:,.2f} ms" if us < 10_000 else f"{us / 1000:,.1f} ms"
    return f"{us:,.1f} µs" if us < 100 else f"{us:,.0f} µs"


def _time_axis(axis) -> None:
    """Log-scale time ticks in words: 10 µs, 100 µs, 1 ms, ... (the values are in µs)."""
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda us, _: f"{us:g} µs" if us < 1000 else f"{us / 1000:g} ms"))


def _caption(ax, text: str) -> None:
    """Source of the numbers, under the x label of ``ax`` (bbox_inches='tight' keeps it in)."""
    ax.annotate(text, xy=(0, 0), xycoords="axes fraction", xytext=(0, -50), textcoords="offset points",
                fontsize=11, color=DARK, va="top", ha="left")


def _bar_panel(ax, row: dict, series, title: str) -> None:
    """Horizontal bars of one workload, log time axis, each bar labelled with its time."""
    items = [(label, row[key + "_s"] * 1e6, colour) for key, label, colour in series
             if row.get(key + "_s")]
    ys = list(range(len(items)))[::-1]
    for y, (label, us, colour) in zip(ys, items):
        ax.barh(y, us, color=colour, edgecolor=DARK, linewidth=0.6, height=0.7)
        ax.text(us * 1.12, y, _fmt_us(us), va="center", ha="left", fontsize=11)
    ax.set_yticks(ys, [label for label, _, _ in items], fontsize=11.5)
    ax.set_xscale("log")
    lo = min(us for _, us, _ in items)
    hi = max(us for _, us, _ in items)
    ax.set_xlim(lo / 2, hi * 5)
    _time_axis(ax.xaxis)
    ax.set_xlabel("time per call (log scale)", fontsize=11)
    ax.set_title(title, fontsize=12.5, loc="left")
    ax.tick_params(axis="x", labelsize=10.5)
    ax.grid(axis="x", color=LIGHT, linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _run_caption(run: dict) -> str:
    return f"{run['device']}, {run['date']}\nraw results: docs/benchmarks-data/{H200_RUN}"


def fig_bench_h200_decode():
    run = _load(H200_RUN)
    rows = _rows(run)
    fig, axes = plt.subplots(2, 1, figsize=(6.6, 8.6), gridspec_kw={"hspace": 0.6})
    for ax, name in zip(axes, ("decode-f16", "decode-f32")):
        r = rows[name]
        cache = "float16" if name.endswith("f16") else "float32"
        _bar_panel(ax, r, [FLOOR, OURS, OURS_CALL, *PEERS],
                   f"MSA decode, {cache} cache: B = {r['B']}, L = {r['L']:,}, one query each")
    _caption(axes[-1], _run_caption(run))
    return fig


def fig_bench_h200_prefill():
    run = _load(H200_RUN)
    r = _rows(run)["prefill-f16"]
    fig, ax = plt.subplots(figsize=(6.6, 3.8))
    _bar_panel(ax, r, [FLOOR, OURS, OURS_CALL, *PEERS],
               f"MSA prefill, float16 cache: B = {r['B']}, L = {r['L']:,}, the last {r['Tq']:,} queries")
    _caption(ax, _run_caption(run))
    return fig


def fig_bench_h200_sweeps():
    run = _load(H200_RUN)
    rows = [r for r in run["rows"] if r["workload"].startswith("sweep-")]
    base = {"L": 32768, "B": 8, "G": 8}
    series = [OURS, OURS_CALL, PEERS[0], PEERS[1], FLOOR]
    fig, axes = plt.subplots(3, 1, figsize=(8.0, 11.0), gridspec_kw={"hspace": 0.6})
    for ax, var, what in zip(axes, ("L", "B", "G"), ("KV length L", "sequences B", "GQA group G")):
        pts = sorted((r[var], r) for r in rows if all(r[k] == v for k, v in base.items() if k != var))
        xs = [x for x, _ in pts]
        for key, label, colour in series:
            ys = [r[key + "_s"] * 1e6 if r.get(key + "_s") else float("nan") for _, r in pts]
            ls = "--" if key == "floor" else "-"
            ax.plot(xs, ys, ls, marker="o", color=colour if key != "floor" else DARK, label=label,
                    linewidth=2.0, markersize=6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs], fontsize=11)
        _time_axis(ax.yaxis)
        ax.tick_params(axis="y", labelsize=10.5)
        ax.set_xlabel(what, fontsize=11.5)
        ax.set_ylabel("time per call", fontsize=11.5)
        fixed = ", ".join(f"{k} = {v // 1024}k" if k == "L" else f"{k} = {v}" for k, v in base.items() if k != var)
        ax.set_title(f"decode, float16 cache: {what} varies ({fixed})", fontsize=12.5, loc="left")
        ax.grid(color=LIGHT, linewidth=0.8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].legend(fontsize=10.5, loc="upper center", bbox_to_anchor=(0.5, 1.55), ncol=2, frameon=False)
    _caption(axes[-1], _run_caption(run))
    return fig


def fig_bench_cpu():
    run = _load(CPU_RUN)
    fig, axes = plt.subplots(2, 1, figsize=(6.6, 4.8), gridspec_kw={"hspace": 0.9})
    for ax, r in zip(axes, run["rows"]):
        items = [("gather floor", r["gather_floor_s"] * 1e3, GREY),
                 ("forward()", r["forward_s"] * 1e3, BLUE)]
        for y, (label, ms, colour) in enumerate(items):
            ax.barh(y, ms, color=colour, edgecolor=DARK, linewidth=0.6, height=0.7)
            ax.text(ms * 1.02 + 1, y, f"{ms:,.1f} ms", va="center", ha="left", fontsize=11)
        ax.set_yticks(range(len(items)), [label for label, _, _ in items], fontsize=11.5)
        ax.set_xlim(0, max(ms for _, ms, _ in items) * 1.25)
        ax.set_xlabel("ms per call", fontsize=11)
        ax.tick_params(axis="x", labelsize=10.5)
        ax.set_title(f"{r['workload']}: B = {r['B']}, L = {r['L']:,}, Tq = {r['Tq']}, float32",
                     fontsize=12.5, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    _caption(axes[-1], f"{run['machine']}, {run['date']}\nraw results: docs/benchmarks-data/{CPU_RUN}")
    return fig


FIGURES = {
    "paged-layout.svg": fig_paged_layout,
    "kv-outer.svg": fig_kv_outer,
    "causal.svg": fig_causal,
    "bench-h200-decode.png": fig_bench_h200_decode,
    "bench-h200-prefill.png": fig_bench_h200_prefill,
    "bench-h200-sweeps.png": fig_bench_h200_sweeps,
    "bench-cpu.png": fig_bench_cpu,
}


def smallest_text_px(fig, fmt: str) -> tuple[float, str]:
    """Size in CSS px of the figure's smallest visible text once shown in the docs' column.

    A browser shows an SVG at its own size (1 pt = 96/72 px) and a PNG at one CSS px per pixel,
    both scaled down to fit ``DISPLAY_PX``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(fig).get_renderer()
    width_in = fig.get_tightbbox(renderer).width + 2 * PAD_INCHES
    px_per_in = PNG_DPI if fmt == "png" else 96
    scale = min(1.0, DISPLAY_PX / (width_in * px_per_in))
    hidden = {id(t) for ax in fig.axes if not ax.axison for t in ax.xaxis.findobj(Text) + ax.yaxis.findobj(Text)}
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden]
    t = min(texts, key=lambda t: t.get_fontsize())
    return t.get_fontsize() * px_per_in / 72 * scale, t.get_text()


def render(make, fmt: str = "svg") -> tuple[bytes, float, str]:
    """The figure's file content, and its smallest text in px at the docs' width (and that text)."""
    fig = make()
    px, text = smallest_text_px(fig, fmt)
    buf = io.BytesIO()
    if fmt == "png":
        fig.savefig(buf, format="png", dpi=PNG_DPI, metadata={"Software": None}, bbox_inches="tight",
                    pad_inches=PAD_INCHES)
    else:
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight", pad_inches=PAD_INCHES)
    plt.close(fig)
    return buf.getvalue(), px, text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed figure differs")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stale, small = [], []
    for name, make in FIGURES.items():
        data, px, text = render(make, name.rsplit(".", 1)[1])
        if px < MIN_TEXT_PX:
            small.append(f"{name}: {text!r} is {px:.1f} px at {DISPLAY_PX} px wide (at least {MIN_TEXT_PX})")
            continue
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(name)
        else:
            path.write_bytes(data)
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    for line in small:
        print("text too small, not written: " + line)
    if stale:
        print("out of date: " + ", ".join(stale) + " (run python scripts/make_figures.py)")
    return 1 if stale or small else 0


if __name__ == "__main__":
    sys.exit(main())
