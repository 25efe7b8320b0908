"""Quality vs latency: each configuration with both an eval and a bench result is a point (decode tokens/s,
perplexity increase over its reference); the Pareto front (no other point is both faster and better) is drawn as
a line. A sweep has dozens of points, so a label on each would be unreadable: colour says the weights, marker
shape the speculation, fill the KV cache (filled fp, half int8, hollow int4/int2); only the front's points and the
peers (transformers, black stars) carry a text label. Rendered with matplotlib's Agg backend (no display)."""

from pathlib import Path

MARKERS = {"none": "o", "lookup": "^", "self": "s", "draft": "D"}
FILLS = {"fp": "full", "int8": "bottom"}  # any other KV kind: hollow


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points (speed: higher is better, loss: lower is better) that no other point dominates."""
    front = []
    for i, (speed, loss) in enumerate(points):
        dominated = any(s >= speed and l <= loss and (s > speed or l < loss) for j, (s, l) in enumerate(points)
                        if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plottable(rows) -> list:
    return [r for r in rows if r.ppl_increase is not None and r.tokens_per_s]


def _weights_label(row) -> str:
    """The weights (and non-default engine settings such as engine.native_dot=int8): one colour each."""
    return row.label.split(",")[0] + (f" {row.variant}" if getattr(row, "variant", "") else "")


def plot_pareto(rows, path: str | Path, title: str = "Quality vs decode speed") -> Path | None:
    """Write the PNG; None when no configuration has both figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = plottable(rows)
    if not rows:
        return None
    points = [(r.tokens_per_s, 100 * r.ppl_increase) for r in rows]
    ours = [i for i, r in enumerate(rows) if not r.peer]
    front = [ours[i] for i in pareto_front([points[i] for i in ours])]
    weights = list(dict.fromkeys(_weights_label(rows[i]) for i in ours))
    colours = {w: plt.get_cmap("tab10")(n % 10) for n, w in enumerate(weights)}
    fig, ax = plt.subplots(figsize=(12, 7.5), dpi=120)
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "-", color="tab:red", linewidth=1.5,
            zorder=1, label="Pareto front (ours)")
    for i in ours:
        row = rows[i]
        ax.plot(*points[i], marker=MARKERS.get(row.spec, "P"), markersize=9, linestyle="none",
                color=colours[_weights_label(row)], fillstyle=FILLS.get(row.kv, "none"), markeredgewidth=1.5,
                zorder=2)
    for i, row in enumerate(rows):
        if row.peer:
            ax.plot(*points[i], marker="*", markersize=14, color="black", linestyle="none", zorder=3)
    middle = (min(p[0] for p in points) + max(p[0] for p in points)) / 2
    peers = [i for i, r in enumerate(rows) if r.peer]
    # the front's labels above their points, the peers' below theirs (both sit near zero loss), staggered
    placed = [(i, 10 + 12 * (n % 2)) for n, i in enumerate(front)] + [(i, -16 - 12 * n) for n, i in enumerate(peers)]
    for i, dy in placed:
        right_half = points[i][0] > middle  # labels of the right half point left, so none runs off the plot
        ax.annotate(rows[i].label, points[i], textcoords="offset points", xytext=(-8 if right_half else 8, dy),
                    ha="right" if right_half else "left", va="center", fontsize=8,
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    handles = [Line2D([], [], color=colours[w], marker="o", linestyle="none", markersize=8, label=w)
               for w in weights]
    handles += [Line2D([], [], color="gray", marker=m, linestyle="none", markersize=8, fillstyle="none",
                       label=f"spec {s}") for s, m in MARKERS.items() if any(r.spec == s for r in rows)]
    kvs = list(dict.fromkeys(r.kv for r in rows if not r.peer))
    handles += [Line2D([], [], color="gray", marker="o", linestyle="none", markersize=8,
                       fillstyle=FILLS.get(k, "none"), label=f"kv {k}") for k in kvs]
    if any(r.peer for r in rows):
        handles.append(Line2D([], [], color="black", marker="*", linestyle="none", markersize=12,
                              label="peer (transformers, fp32)"))
    handles.append(Line2D([], [], color="tab:red", label="Pareto front (ours)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.margins(x=0.1, y=0.1)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("decode tokens/s (higher is better)")
    ax.set_ylabel("perplexity increase over the reference, % (lower is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
