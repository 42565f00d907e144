"""Writing an evaluation's results: JSON, a markdown table and a PNG plot (policy curves over budgets)."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def markdown_table(table: dict[str, dict[str, float]], fmt: str = "{:.3f}") -> str:
    """{policy: {budget: value}} -> a markdown table, one row per policy, one column per budget."""
    budgets = sorted({b for row in table.values() for b in row}, key=int)
    lines = ["| policy | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(fmt.format(row[b]) if b in row else "" for b in budgets) + " |")
    return "\n".join(lines)


def plot(tables: dict[str, dict[str, dict[str, float]]], path: str, title: str) -> None:
    """One panel per metric; a line per policy over budgets (log2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
    # One colour per policy in every panel, even where a panel lacks some policy (e.g. "full" in deltas).
    names = list(dict.fromkeys(n for table in tables.values() for n in table))
    colours = {n: f"C{i}" for i, n in enumerate(names)}
    for ax, (metric, table) in zip(axes[0], tables.items()):
        for name, row in table.items():
            budgets = sorted(row, key=int)
            ax.plot([int(b) for b in budgets], [row[b] for b in budgets], marker="o", label=name,
                    color=colours[name])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget B (tokens)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out_dir: str, name: str, markdown: str, plot_to) -> dict[str, str]:
    """Writes NAME.json (results), NAME.md (markdown) and NAME.png (plot_to(path)) into out_dir; returns paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"{name}.{ext}") for ext in ("json", "md", "png")}
    with open(paths["json"], "w") as f:
        json.dump(json_safe(results), f, indent=2, allow_nan=False)
    with open(paths["md"], "w") as f:
        f.write(markdown)
    plot_to(paths["png"])
    return paths


def write_report(results: dict[str, Any], out_dir: str, name: str, tables: dict[str, dict], title: str,
                 fmt: str = "{:.3f}") -> dict[str, str]:
    """An evaluation's NAME.json, NAME.md (a table per metric) and NAME.png (policy curves) in out_dir."""
    markdown = f"# {title}\n\n" + "".join(
        f"## {metric}\n\n{markdown_table(table, fmt)}\n\n" for metric, table in tables.items())
    return write_outputs(results, out_dir, name, markdown, lambda path: plot(tables, path, title))


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN or infinite float as None (JSON has no NaN: `json.dump` would write invalid JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return json_safe(obj.item())
    return obj
