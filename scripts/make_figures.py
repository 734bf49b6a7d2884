"""Generate the documentation figures into docs/figures/.

    python scripts/make_figures.py            # writes docs/figures/*.svg and the bench-*.png plots
    python scripts/make_figures.py --check    # exit 1 if a committed figure is out of date

The diagrams (SVG) are drawn from the examples of the spec pages; the benchmark plots (PNG) from
the committed results in docs/benchmarks-data/*.json, never from numbers typed here. The output
is deterministic (fixed SVG hash salt, no date or software metadata), so the figures can be
committed and re-generated without spurious diffs (PNG bytes also depend on the matplotlib and
FreeType versions). Needs matplotlib.

Sizes are chosen for the page: the docs show a figure at most about 900 px wide, so a figure
``w`` inches wide is scaled by about ``900 / (w * 72)`` in SVG; its text is set large enough to
stay at least 12 px after that scaling.
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
    S, BS = 2, 4  # page_size, block_size -> ppb = 2
    ppb = BS // S
    table = [7, 2, -1, 5, 0, 9, 3, -1, 4]  # max_pages = 9 -> msb = 4: page 8 is never read
    max_pages = len(table)
    msb = max_pages // ppb
    L = 13  # used_kv_len
    P = 10

    fig, ax = plt.subplots(figsize=(10.5, 6.2))
    ax.set_xlim(-3.9, 19.2)
    ax.set_ylim(-1.8, 11.0)
    ax.axis("off")

    cw = 1.0  # width of one logical position
    # --- logical positions -------------------------------------------------------------
    y_pos = 8.6
    ax.text(-3.8, y_pos + 0.4, "logical\npositions p\nof sequence b", va="center", ha="left",
            fontsize=9)
    for p in range(max_pages * S):
        page = p // S
        blk = page // ppb
        x = p * cw
        if page >= msb * ppb:
            fc, hatch = "white", "xx"
        elif table[page] < 0:
            fc, hatch = "white", "////"
        elif p >= L:
            fc, hatch = LIGHT, ".."
        else:
            fc, hatch = _light(BLOCK_COLOURS[blk % 4]), None
        _box(ax, x, y_pos, cw, 0.8, fc, hatch=hatch, lw=0.6)
        ax.text(x + cw / 2, y_pos + 0.4, str(p), ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none") if hatch else None)
    # page brackets
    for page in range(max_pages):
        x0 = page * S * cw
        ax.plot([x0 + 0.08, x0 + S * cw - 0.08], [y_pos - 0.15] * 2, color=DARK, lw=1.0)
        ax.text(x0 + S * cw / 2, y_pos - 0.45, f"page {page}", ha="center", va="center",
                fontsize=7.5)
    # block brackets
    for blk in range(msb):
        x0 = blk * BS * cw
        ax.plot([x0 + 0.05, x0 + BS * cw - 0.05], [y_pos + 1.05] * 2, color=BLOCK_COLOURS[blk % 4],
                lw=2.2)
        ax.text(x0 + BS * cw / 2, y_pos + 1.35, f"block s={blk}", ha="center", va="center",
                fontsize=9, color=BLOCK_COLOURS[blk % 4], fontweight="bold", zorder=5,
                bbox=dict(boxstyle="square,pad=0.15", fc="white", ec="none"))
    x_tail = msb * BS * cw
    ax.text(x_tail + S * cw / 2, y_pos + 1.35, "past msb·ppb:\nnever read", ha="center",
            va="center", fontsize=7.5, color=DARK)
    # L_b cut
    ax.plot([L * cw, L * cw], [y_pos - 0.1, y_pos + 1.9], color=RED, lw=2.0, ls="--")
    ax.text(L * cw + 0.1, y_pos + 2.05, f"L_b = {L}", color=RED, fontsize=9, ha="center",
            fontweight="bold")

    # --- block_tables row ----------------------------------------------------------------
    y_bt = 5.6
    ax.text(-3.8, y_bt + 0.4, "block_tables[b]", va="center", ha="left", fontsize=9,
            family="DejaVu Sans Mono")
    for page in range(max_pages):
        x = page * S * cw + 0.25
        v = table[page]
        fc = "white" if v < 0 else _light(SKY, 0.4)
        if page >= msb * ppb:
            fc = "white"
        _box(ax, x, y_bt, S * cw - 0.5, 0.8, fc, hatch="////" if v < 0 else None)
        ax.text(x + (S * cw - 0.5) / 2, y_bt + 0.4, str(v), ha="center", va="center",
                fontsize=10, fontweight="bold", family="DejaVu Sans Mono",
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none") if v < 0 else None)
        _arrow(ax, (page * S * cw + S * cw / 2, y_pos - 0.6), (page * S * cw + S * cw / 2, y_bt + 0.85),
               color=GREY, lw=0.8)

    # --- physical pages ------------------------------------------------------------------
    y_phys = 1.2
    pw = 1.7
    ax.text(-3.8, y_phys + 0.55, "k_cache\n[P, Hkv, S, D]", va="center", ha="left", fontsize=9,
            family="DejaVu Sans Mono")
    owner = {}
    for page in range(min(max_pages, msb * ppb)):
        if table[page] >= 0:
            owner[table[page]] = page
    for j in range(P):
        x = j * pw + 0.1
        if j in owner:
            blk = owner[j] // ppb
            partly_past = owner[j] * S + S > L
            fc = _light(BLOCK_COLOURS[blk % 4])
            hatch = ".." if partly_past else None
        else:
            fc, hatch = LIGHT, None
        _box(ax, x, y_phys, pw - 0.3, 1.1, fc, hatch=hatch)
        # Hkv sub-rows inside a page
        for r in (1, 2):
            ax.plot([x, x + pw - 0.3], [y_phys + r * 1.1 / 3] * 2, color=DARK, lw=0.4)
        ax.text(x + (pw - 0.3) / 2, y_phys - 0.3, f"page {j}", ha="center", va="center",
                fontsize=8)
    ax.text(P * pw + 0.05, y_phys + 0.55, "each page:\nHkv rows of\nS positions × D",
            fontsize=7.5, va="center", ha="left")
    for page in range(min(max_pages, msb * ppb)):
        v = table[page]
        if v < 0:
            continue
        x0 = page * S * cw + S * cw / 2
        x1 = v * pw + 0.1 + (pw - 0.3) / 2
        _arrow(ax, (x0, y_bt - 0.05), (x1, y_phys + 1.15), color=BLOCK_COLOURS[(page // ppb) % 4],
               lw=1.1)

    # --- legend -----------------------------------------------------------------------------
    y_leg = -0.45
    items = [
        (_light(BLUE), None, "attendable (if selected)"),
        ("white", "////", "unmapped page (-1): skipped"),
        (LIGHT, "..", "position ≥ L_b: never read"),
        ("white", "xx", "page ≥ msb·ppb: never read"),
    ]
    for k, (fc, hatch, label) in enumerate(items):
        x, y = (k % 2) * 9.0, y_leg - (k // 2) * 0.6
        _box(ax, x, y, 0.6, 0.45, fc, hatch=hatch, lw=0.6)
        ax.text(x + 0.8, y + 0.22, label, va="center", fontsize=8.5)
    ax.text(8.0, -1.45,
            f"S = page_size = {S},  BS = block_size = {BS},  ppb = {ppb},  max_pages = {max_pages},  "
            f"msb = {msb},  P = {P}",
            ha="center", va="center", fontsize=9)
    return fig


# --------------------------------------------------------------------------------------------
# kv-outer.svg
# --------------------------------------------------------------------------------------------

SELECTED = {0: [0, 2], 1: [2, 0], 2: [1, 3], 3: [3, 0]}  # one sequence, one KV head, topk = 2


def fig_kv_outer():
    fig, (axl, axr) = plt.subplots(1, 2, figsize=(10.0, 4.6),
                                   gridspec_kw={"width_ratios": [1.0, 2.1]})
    for ax in (axl, axr):
        ax.axis("off")

    # --- left: query-outer -----------------------------------------------------------------
    axl.set_xlim(0, 6)
    axl.set_ylim(-0.4, 5.4)
    axl.set_title("query-outer: each query gathers its top-k blocks", fontsize=10)
    ys = {t: 4.2 - t * 1.2 for t in range(4)}
    bys = {s: 4.2 - s * 1.2 for s in range(4)}
    for t, y in ys.items():
        _box(axl, 0.3, y, 1.2, 0.7, _light(SKY, 0.3))
        axl.text(0.9, y + 0.35, f"t{t}", ha="center", va="center", fontweight="bold")
    for s, y in bys.items():
        _box(axl, 4.2, y, 1.5, 0.7, _light(BLOCK_COLOURS[s]))
        axl.text(4.95, y + 0.35, f"block {s}", ha="center", va="center")
    for t, blocks in SELECTED.items():
        for s in blocks:
            _arrow(axl, (1.55, ys[t] + 0.35), (4.15, bys[s] + 0.35), color=BLOCK_COLOURS[s], lw=1.1)
    axl.text(3.0, -0.25, "8 block loads for 4 queries", ha="center", fontsize=9, color=RED)

    # --- right: KV-outer -------------------------------------------------------------------
    axr.set_xlim(0, 12.5)
    axr.set_ylim(-0.4, 5.4)
    axr.set_title("KV-outer: each block is loaded once for the queries that chose it", fontsize=10)
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
    axr.text(1.2, 5.15, "slot groups (b, s)", ha="center", fontsize=8.5, style="italic")
    axr.text(5.15, 5.15, "edges → partials (o, m, l)", ha="center", fontsize=8.5, style="italic")
    axr.text(10.6, 5.15, "combine (R15)", ha="center", fontsize=8.5, style="italic")
    for s, es in groups.items():
        top = ey[es[0]] + 0.25
        bot = ey[es[-1]] - 0.25
        _box(axr, 0.2, bot, 2.0, top - bot, _light(BLOCK_COLOURS[s]))
        qs = ", ".join(f"t{edges[e][1]}" for e in es)
        if len(es) == 1:
            axr.text(1.2, (top + bot) / 2, f"block {s}: {qs}", ha="center", va="center",
                     fontsize=8, fontweight="bold")
        else:
            axr.text(1.2, (top + bot) / 2 + 0.1, f"block {s}", ha="center", va="center",
                     fontsize=9, fontweight="bold")
            axr.text(1.2, (top + bot) / 2 - 0.2, f"K/V loaded once\nfor {qs}", ha="center",
                     va="top", fontsize=6.5)
        for e in es:
            _arrow(axr, (2.25, ey[e]), (3.35, ey[e]), color=BLOCK_COLOURS[s], lw=0.9)
    for e, (s, t, r) in enumerate(edges):
        _box(axr, 3.4, ey[e] - 0.22, 3.5, 0.44, "white", ec=BLOCK_COLOURS[s])
        axr.text(5.15, ey[e], f"e{e}: t{t}, s={s}, r={r} → (o, m, l)", ha="center",
                 va="center", fontsize=7.2)
    qy = {t: 4.2 - t * 1.2 for t in range(4)}
    for t, y in qy.items():
        _box(axr, 9.6, y, 2.0, 0.7, _light(SKY, 0.3))
        axr.text(10.6, y + 0.35, f"t{t}: out, lse", ha="center", va="center", fontsize=8.5,
                 fontweight="bold")
    for e, (s, t, r) in enumerate(edges):
        _arrow(axr, (6.95, ey[e]), (9.55, qy[t] + 0.35), color=GREY, lw=0.9)
    axr.text(6.2, -0.25, "4 block loads for the same 8 edges; all G query heads of the KV head "
             "share each load", ha="center", fontsize=9, color=GREEN)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# causal.svg
# --------------------------------------------------------------------------------------------

def _causal_panel(ax, L, T, BS, title, dropped=()):
    ax.set_xlim(-2.2, max(L, 2) + 3.6)
    ax.set_ylim(-1.4, T + 1.4)
    ax.invert_yaxis()
    ax.axis("off")
    ax.set_title(title, fontsize=10)
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
                ax.text(p + 0.5, i + 0.5, "✓", ha="center", va="center", fontsize=9)
        ax.text(-0.2, i + 0.5, f"i={i}", ha="right", va="center", fontsize=9)
        txt = f"p ≤ {hi}" if hi >= 0 else f"p ≤ {hi}: none"
        ax.text(L + 0.25, i + 0.5, txt, ha="left", va="center", fontsize=8.5,
                color=RED if hi < 0 else DARK)
    for p in range(L):
        ax.text(p + 0.5, -0.3, str(p), ha="center", va="center", fontsize=8)
    for blk in range((L + BS - 1) // BS):
        x0, x1 = blk * BS, min((blk + 1) * BS, L)
        ax.plot([x0 + 0.05, x1 - 0.05], [-0.85, -0.85], color=BLOCK_COLOURS[blk % 4], lw=2.2)
        ax.text((x0 + x1) / 2, -1.15, f"block {blk}", ha="center", va="center", fontsize=8,
                color=BLOCK_COLOURS[blk % 4], fontweight="bold")
    ax.text(-2.1, -0.3, "p →", ha="left", va="center", fontsize=8)


def fig_causal():
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.0, 3.3), gridspec_kw={"width_ratios": [1.9, 1.0]})
    _causal_panel(a, 10, 3, 4, "L_b = 10, T_b = 3, BS = 4: query i sees p ≤ L_b − T_b + i",
                  dropped={(0, 2)})
    _causal_panel(b, 2, 4, 4, "L_b = 2, T_b = 4: T_b > L_b")
    a.text(5.0, 3.75, "xx: block 2 lies entirely in the future of i=0, so no edge is kept (R13)",
           ha="center", fontsize=8.5)
    b.text(1.0, 4.75, "i=0, 1 see nothing: out = 0, lse = −inf", ha="center", fontsize=8.5,
           color=RED)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# bench-*.png: the benchmark results, one question per figure
# --------------------------------------------------------------------------------------------

# (JSON key prefix, label, colour); ours first, then the peers. "_e2e" is a whole forward() call.
OURS = ("wgpu", "wgpu kernels (partials + combine)", BLUE)
OURS_CALL = ("wgpu_e2e", "wgpu: a user's forward() call", SKY)
PEERS = [
    ("torch gather+SDPA bf16", "torch gather+SDPA bf16", ORANGE),
    ("torch dense SDPA bf16", "torch dense SDPA bf16", GREEN),
    ("torch FlexAttention bf16", "torch FlexAttention bf16", PURPLE),
    ("torch dense SDPA f32", "torch dense SDPA f32", RED),
]
FLOOR = ("floor", "memory floor (needed bytes / bandwidth)", GREY)


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
                fontsize=9.5, color=DARK, va="top", ha="left")


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
    fig, axes = plt.subplots(2, 1, figsize=(8.0, 8.2), gridspec_kw={"hspace": 0.55})
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
    fig, ax = plt.subplots(figsize=(8.0, 3.6))
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
    fig, axes = plt.subplots(2, 1, figsize=(8.0, 4.6), gridspec_kw={"hspace": 0.9})
    for ax, r in zip(axes, run["rows"]):
        items = [("gather floor (numpy fancy indexing)", r["gather_floor_s"] * 1e3, GREY),
                 ("numpy backend forward()", r["forward_s"] * 1e3, BLUE)]
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


def render(make, fmt: str = "svg") -> bytes:
    fig = make()
    buf = io.BytesIO()
    if fmt == "png":
        fig.savefig(buf, format="png", dpi=PNG_DPI, metadata={"Software": None}, bbox_inches="tight",
                    pad_inches=0.15)
    else:
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed figure differs")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stale = []
    for name, make in FIGURES.items():
        data = render(make, name.rsplit(".", 1)[1])
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(name)
        else:
            path.write_bytes(data)
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if stale:
        print("out of date: " + ", ".join(stale) + " (run python scripts/make_figures.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
