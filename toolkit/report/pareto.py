"""Quality vs latency: each configuration with both an eval and a bench result is a point (decode tokens/s,
perplexity increase over its reference); the Pareto front (no other point is both faster and better) is drawn as
a line and its points are filled. Rendered with matplotlib's Agg backend (no display needed)."""

from pathlib import Path


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


def plot_pareto(rows, path: str | Path, title: str = "Quality vs decode speed") -> Path | None:
    """Write the PNG; None when no configuration has both figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plottable(rows)
    if not rows:
        return None
    points = [(r.tokens_per_s, 100 * r.ppl_increase) for r in rows]
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    others = [i for i in range(len(rows)) if i not in front]
    ax.scatter([points[i][0] for i in others], [points[i][1] for i in others], s=60, facecolors="none",
               edgecolors="tab:gray", label="dominated")
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "-o", color="tab:red", markersize=8,
            label="Pareto front")
    middle = (min(p[0] for p in points) + max(p[0] for p in points)) / 2
    for i, row in enumerate(rows):
        right_half = points[i][0] > middle  # labels of the right half point left, so none runs off the plot
        ax.annotate(row.label, points[i], textcoords="offset points", xytext=(-6 if right_half else 6, 6),
                    ha="right" if right_half else "left", fontsize=8)
    ax.margins(x=0.08, y=0.08)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("decode tokens/s (higher is better)")
    ax.set_ylabel("perplexity increase over the reference, % (lower is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
