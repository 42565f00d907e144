"""Benchmark tables (markdown), plots and files."""

from __future__ import annotations

from typing import Any

from clusterkv_jax.eval.report import write_outputs


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def format_decode_context(context: int, row: dict[str, Any]) -> str:
    lines = [f"context {context}",
             "| policy | prefill s | indexing s (share) | decode ms/token | tokens/s | vs full | x roofline | "
             "end-to-end s | device KV MB | host KV MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    hits = any("recall_hit_rate" in r for r in row.values())
    twins = any("speedup_vs_on_device" in r for r in row.values())
    if twins:  # offloaded twins of on-device policies: the ratio of the two
        lines[1] += " vs on device |"
        lines[2] += "---|"
    if hits:  # offloaded: the recall cache's hit rate
        lines[1] += " recall hit rate |"
        lines[2] += "---|"
    for name, r in row.items():
        share = r.get("indexing_share_of_prefill")
        indexing = "" if r.get("indexing_s") is None else (
            f"{r['indexing_s']:.2f}" + (f" ({100 * share:.1f}%)" if share is not None else ""))
        kvb = r.get("kv_bytes", {})
        lines.append(
            f"| {name} | {_fmt(r.get('prefill_s'), '.2f')} | {indexing} | {r['decode_ms']:.1f} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['speedup_vs_full']:.2f}x | {_fmt(r.get('x_roofline'), '.1f')} | "
            f"{_fmt(r.get('end_to_end_s'), '.2f')} | {_fmt(kvb.get('device', 0) / 1e6 if kvb else None, '.0f')} | "
            f"{_fmt(kvb.get('host', 0) / 1e6 if kvb else None, '.0f')} |"
            + (f" {_fmt(r.get('speedup_vs_on_device'), '.2f')}{'x' * ('speedup_vs_on_device' in r)} |" if twins else "")
            + (f" {_fmt(r.get('recall_hit_rate'), '.3f')} |" if hits else ""))
    return "\n".join(lines)


def format_decode(results: dict[str, Any]) -> str:
    head = (f"decode: batch {results['batch']}, {results['decode']} steps (median after {results['warmup_steps']} "
            f"warm-up), {results['dtype']}")
    if results.get("mesh"):
        head += f", mesh {results['mesh']} over {results['devices']} devices"
    if results.get("bandwidth_Bps"):
        head += f", measured bandwidth {results['bandwidth_Bps'] / 1e9:.1f} GB/s"
    parts = [head] + [format_decode_context(int(c), row) for c, row in results["contexts"].items()]
    hf = [f"- context {c}: HF transformers full KV {row['hf-full']['decode_ms']:.1f} ms/token, prefill "
          f"{row['hf-full']['prefill_s']:.2f} s; ours full KV {row['full']['decode_ms']:.1f} ms/token, prefill "
          f"{row['full']['prefill_s']:.2f} s" for c, row in results["contexts"].items() if "hf-full" in row]
    if hf:
        parts.append("HF transformers, same weights, interleaved:\n" + "\n".join(hf))
    loops = [(c, name, r["decode_loop"]) for c, row in results["contexts"].items() for name, r in row.items()
             if "decode_loop" in r]
    if loops:
        lines = [f"generate's decode loop: one program vs chunks of about {loops[0][2]['chunk_seconds']:g} s that "
                 f"Ctrl-C can stop (alternated; medians of {loops[0][2]['rounds']} rounds, the cost of each round's "
                 "ratio)", "| context | policy | one program ms/token | chunked ms/token | "
                 "chunks | chunked cost |", "|---|---|---|---|---|---|"]
        lines += [f"| {c} | {name} | {lp['one_program_ms']:.2f} | {lp['chunked_ms']:.2f} | {lp['chunks']:g} | "
                  f"{100 * lp['chunked_cost']:+.2f}% |" for c, name, lp in loops]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def format_attention(results: dict[str, Any]) -> str:
    g = results["geometry"]
    lines = [f"one layer's decode attention: {g['num_heads']} q heads, {g['num_kv_heads']} KV heads, "
             f"d {g['head_dim']}, batch {results['batch']}, {results['dtype']}",
             "| context | " + " | ".join(next(iter(results["contexts"].values()))) + " |"]
    lines.append("|---|" + "---|" * (lines[-1].count("|") - 2))
    for c, row in results["contexts"].items():
        lines.append(f"| {c} | " + " | ".join(f"{r['ms']:.2f} ms ({r['speedup_vs_full']:.1f}x)" for r in row.values())
                     + " |")
    for c, row in results["contexts"].items():
        for name, r in row.items():
            if "select_in_step_ms" in r:
                alone = row[f"{name} select"]
                lines.append(f"{name} at {c}: select alone {alone['ms']:.2f} ms "
                             f"({alone['share_of_policy_attention']:.0%} of the step), "
                             f"in the step {r['select_in_step_ms']:.2f} ms ({r['select_share_in_step']:.0%}: "
                             f"the step {r['ms']:.2f} ms, given the selection {r['given_selection_ms']:.2f} ms)")
    return "\n".join(lines)


def format_offload(results: dict[str, Any]) -> str:
    lines = [f"ClusterKV offload: context {results['context']}, {results['new_tokens']} generated tokens, "
             f"B={results['budget']}",
             "| R | hit rate | rows fetched per step (all layers, heads) | device KV bytes | host KV bytes |",
             "|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        lines.append(f"| {name[2:]} | {r['hit_rate']:.3f} | {r['rows_fetched_per_step']:.0f} | "
                     f"{r['kv_bytes']['device']:,} | {r['kv_bytes']['host']:,} |")
    p = results["prefill"]
    lines.append(f"prefill: full KV {p['full']['prefill_s']:.2f}s, ClusterKV {p['clusterkv']['prefill_s']:.2f}s; "
                 f"clustering {results['clustering_s']:.2f}s = {100 * results['clustering_share_of_prefill']:.1f}% "
                 f"of ClusterKV's prefill")
    return "\n".join(lines)


def plot_contexts(results: dict[str, Any], path: str, title: str, panels: list[tuple[Any, str, bool]],
                  level: float | None = 1.0) -> None:
    """One panel per (value of a row, y label, log y) in `panels` against context, a line per contender; the value
    is a row's key or a function of the row. The last panel gets a grey line at `level` (a ratio's 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [int(c) for c in results["contexts"]]
    names = list(dict.fromkeys(n for row in results["contexts"].values() for n in row))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    for i, name in enumerate(names):
        xs = [c for c in contexts if name in results["contexts"][str(c)]]
        rows = [results["contexts"][str(c)][name] for c in xs]
        for ax, (value, _, _) in zip(axes, panels):
            get = value if callable(value) else (lambda r, key=value: r[key])
            ax.plot(xs, [get(r) for r in rows], marker="o", label=name, color=f"C{i}")
    for ax, (_, label, log) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if level is not None:
        axes[-1].axhline(level, color="grey", lw=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(results: dict[str, Any], path: str, title: str) -> None:
    """Decode ms/token (or one layer's ms) and speed-up over full KV against context, a line per policy."""
    plot_contexts(results, path, title, [
        (lambda r: r["decode_ms"] if "decode_ms" in r else r["ms"],
         "ms per decode step" if "decode" in results else "ms per call", True),
        ("speedup_vs_full", "speed-up over full KV", True)])


def write_bench(results: dict[str, Any], out_dir: str, name: str, text: str, title: str) -> dict[str, str]:
    """NAME.json, NAME.md (the printed tables) and NAME.png in out_dir."""
    return write_outputs(results, out_dir, name, f"# {title}\n\n{text}\n",
                         lambda path: plot_decode(results, path, title))
