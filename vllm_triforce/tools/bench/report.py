"""Output files of the benchmarks: results.json, a markdown table, PNG plots (Agg)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)


def write_markdown(path: Path, title: str, sections: list[str]) -> None:
    path.write_text(f"# {title}\n\n" + "\n\n".join(sections) + "\n")


def bar_plot(path: Path, labels: list[str], values: list[float], ylabel: str,
             title: str, groups: dict[str, list[float]] | None = None) -> None:
    """One bar per label, or grouped bars (`groups`: series name -> one value per label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels)), 3.6))
    if groups is None:
        ax.bar(labels, values, color="tab:blue")
    else:
        width = 0.8 / max(len(groups), 1)
        for i, (series, vals) in enumerate(groups.items()):
            xs = [x + (i - (len(groups) - 1) / 2) * width for x in range(len(labels))]
            ax.bar(xs, vals, width, label=series)
        ax.set_xticks(range(len(labels)), labels)
        ax.legend(fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def line_plot(path: Path, xs: list, series: dict[str, list[float]], xlabel: str,
              ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
