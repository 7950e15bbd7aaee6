"""Render evaluation results: a text table, and a report folder (JSON, Markdown, PNG plot)."""

from __future__ import annotations

import json
from pathlib import Path

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
    _plot(results, paths[2])
    return paths


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
