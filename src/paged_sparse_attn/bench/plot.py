"""PNG plots of benchmark results (matplotlib, imported only here)."""

from __future__ import annotations

__all__ = ["plot"]


def plot(result: dict, path: str) -> None:
    """Draw a bench result to ``path`` (PNG).

    GPU suite: per workload, time of each implementation (log scale), with the memory floor
    (needed bytes / measured copy bandwidth) as a line. CPU suite: forward time against the
    gather floor per workload.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("rows", [])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 3), 4.5), dpi=120)
    if result.get("suite") == "gpu":
        skip = ("floor", "_partials", "_combine", "_e2e")
        names = sorted({k[:-2] for r in rows for k in r if k.endswith("_s") and not any(x in k for x in skip)})
        names = [n for n in names if any(r.get(n + "_s") for r in rows)]
        xs = range(len(rows))
        w = 0.8 / max(1, len(names))
        for j, n in enumerate(names):
            ax.bar([x + j * w for x in xs], [r.get(n + "_s") or 0 for r in rows], w, label=n)
        floors = [(x, r["floor_s"]) for x, r in zip(xs, rows) if r.get("floor_s")]
        if floors:  # one black segment across each workload's bars
            ax.hlines([f for _, f in floors], [x - w / 2 for x, _ in floors], [x + 0.8 - w / 2 for x, _ in floors],
                      colors="k", linewidths=2, label="memory floor (needed bytes / copy bandwidth)")
        ax.set_xticks([x + 0.4 - w / 2 for x in xs], [r["workload"] for r in rows], rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("seconds per call")
    else:
        labels = [r["workload"] for r in rows]
        ax.bar([i - 0.2 for i in range(len(rows))], [r["forward_s"] for r in rows], 0.4, label="forward()")
        ax.bar([i + 0.2 for i in range(len(rows))], [r["gather_floor_s"] for r in rows], 0.4, label="gather floor")
        ax.set_xticks(range(len(rows)), labels)
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
    ax.set_title(f"paged_sparse_attn bench ({result.get('suite')}, {result.get('date', '')[:10]})\n"
                 f"{result.get('device', result.get('machine', ''))}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
