"""Render evaluation results: a text table, and a report folder (JSON, Markdown, and PNG plots where matplotlib
is installed: the `plots` extra)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

HEADER = f"{'plan':<10} {'decode loads':>14} {'prefill loads':>14} {'saving':>8} {'capture':>8}"


def format_table(result: dict) -> str:
    """One row per plan, in evaluation order, under a line naming the setting."""
    lines = [f"batch size {result['batch_size']}, {result['num_requests']} requests, "
             f"{result['decode_steps']} decode steps ({result['decode_mode']})", HEADER]
    for name, row in result["plans"].items():
        line = (f"{name:<10} {row['decode_loads']:>14,} {row['prefill_loads']:>14,} "
                f"{row['saving']:>8.1%} {row['capture']:>8.1%}")
        if "decode_loads_std" in row:
            line += f"   (std {row['decode_loads_std']:,.0f} over {row['seeds']} seeds)"
        lines.append(line)
    return "\n".join(lines)


def write_report(results: list[dict], out_dir: str | Path) -> list[Path]:
    """Write report.json, report.md and saving.png (saving against batch size per plan) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md", out / "saving.png"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n")
    paths[1].write_text("# Expert-load evaluation\n\n" + "\n\n".join(
        "```\n" + format_table(r) + "\n```" for r in results) + "\n")
    plt = _pyplot()
    if plt is None:
        return paths[:2]
    _plot(plt, results, paths[2])
    return paths


def _pyplot():
    """matplotlib.pyplot on a non-interactive backend, or None (a warning says how to get the plots)."""
    try:
        import matplotlib
    except ImportError:
        log.warning("no plots: matplotlib is not installed (pip install 'moe-cohort[plots]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot(plt, results: list[dict], path: Path) -> None:
    sizes = [r["batch_size"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in results[0]["plans"]:
        if name != "random":
            ax.plot(sizes, [100 * r["plans"][name]["saving"] for r in results], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode expert-load saving vs random (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


ENGINE_HEADER = (f"{'policy':<22} {'loads/token':>11} {'saving':>8} {'(std)':>7} {'capture':>8} "
                 f"{'MoE us/tok':>10} {'step us/tok':>11} {'tokens/s':>9}")


def format_engine_table(result: dict) -> str:
    """One row per admission policy of a continuous replay (eval.engine.evaluate_continuous)."""
    clients = f", {result['clients']} closed-loop clients" if result.get("clients") else ""
    clients += ", steps with every slot busy only" if result.get("kept_full") else ""
    lines = [f"continuous engine, S = {result['slots']} slots{clients}, {result['num_requests']} requests "
             f"({result['decode_mode']} decode), cost model {result['cost_model']}, capture vs reference", ENGINE_HEADER]
    for name, r in result["plans"].items():
        lines.append(f"{name:<22} {r['loads_per_token']:>11.2f} {r['saving']:>8.1%} {r['saving_std']:>7.1%} "
                     f"{r['capture']:>8.1%} {r['moe_us_per_token']:>10.1f} {r['step_us_per_token']:>11.1f} "
                     f"{r['tokens_per_s']:>9.0f}")
    return "\n".join(lines)


def write_engine_report(static: list[dict], continuous: list[dict], out_dir: str | Path) -> list[Path]:
    """report.json, report.md, saving.png and moe_time.png: every policy against S, static and continuous.

    Static results are eval.metrics.evaluate rows (batch size B = S) with `moe_us_per_token` added."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md", out / "saving.png", out / "moe_time.png"]
    paths[0].write_text(json.dumps({"static": static, "continuous": continuous}, indent=2) + "\n")
    tables = [format_table(r) for r in static] + [format_engine_table(r) for r in continuous]
    paths[1].write_text("# Expert loads: static batches and the continuous engine\n\n" +
                        "\n\n".join("```\n" + t + "\n```" for t in tables) + "\n")
    plt = _pyplot()
    if plt is None:
        return paths[:2]
    _plot_engine(plt, static, continuous, "saving", "saving vs random order (%)", paths[2], scale=100)
    _plot_engine(plt, static, continuous, "moe_us_per_token", "modelled MoE time per token (us)", paths[3])
    return paths


def _plot_engine(plt, static: list[dict], continuous: list[dict], key: str, label: str, path: Path,
                 scale: float = 1) -> None:
    """Continuous policies solid, static plans dashed, against S (= B for static batches)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(n for rs in (continuous, static) for r in rs for n in r["plans"]))
    colour = {n: f"C{i % 10}" for i, n in enumerate(names)}  # one colour per policy in both engines
    for results, size_key, style, tag in ((continuous, "slots", "-", ""), (static, "batch_size", "--", " (static)")):
        for name in (results[0]["plans"] if results else {}):
            rows = [(r[size_key], r["plans"][name][key]) for r in results if key in r["plans"].get(name, {})]
            if rows and not (key == "saving" and name == "random"):
                ax.plot([s for s, _ in rows], [scale * v for _, v in rows], style, marker="o" if tag == "" else "s",
                        color=colour[name], label=name + tag)
    sizes = sorted({r["slots"] for r in continuous} | {r["batch_size"] for r in static})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("S (resident slots; batch size for static plans)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
