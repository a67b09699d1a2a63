"""Draw decode tokens/s against pool capacity from one or more `bench decode --json`
reports, each configuration family a line, its bound drawn dashed beside it.

    python tests/bench/plot_capacity.py OUT_PNG REPORT_JSON [REPORT_JSON ...]

Families: the slot pool alone; the slot pool with the host tier ("+host" of older
reports, "+host:slots" since the tier that holds every expert became a mapped pool); the
mapped pool ("+host" where its row says host_tier "mapped", or "+mapped:g"); other
"+mapped" variants under their own names. Stock mlx-lm and the naive reader are
horizontal lines (one per report that has them: reports from different runs differ).
Needs matplotlib (imported here only; the package itself does not depend on it).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

STYLE = {
    "slot pool": "tab:blue",
    "slot pool + host tier": "tab:green",
    "mapped pool (host RAM holds every expert)": "tab:purple",
}


def family(row: dict) -> str | None:
    """The line a row belongs to, or None for stock and naive (drawn as levels)."""
    name = row["name"]
    if not name.startswith("moestream@"):
        return None
    rest = name.split("+", 1)[1] if "+" in name else ""
    if rest == "":
        return "slot pool"
    if rest == "host:slots" or (rest == "host" and row.get("host_tier", "slots") == "slots"):
        return "slot pool + host tier"
    if (rest == "host" and row.get("host_tier") == "mapped") or rest in ("mapped:g", "mapped"):
        return "mapped pool (host RAM holds every expert)"
    return f"+{rest}"


def plot(reports: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float, float | None]]] = defaultdict(list)
    levels = []
    for i, report in enumerate(reports):
        for row in report["results"]:
            f = family(row)
            if f is None:
                levels.append((row["name"], i, row["tokens_per_s"]))
            elif row["capacity"] is not None:
                lines[f].append((row["capacity"], row["tokens_per_s"], row.get("bound_tokens_per_s")))
    fig, ax = plt.subplots(figsize=(11, 5))
    for f, points in sorted(lines.items()):
        points.sort()
        color = STYLE.get(f)
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] for p in points], marker="o", color=color, label=f)
        if any(p[2] is not None for p in points):
            ax.plot(
                xs, [p[2] if p[2] is not None else float("nan") for p in points], linestyle="--", color=color, alpha=0.6
            )
    for name, i, tps in levels:
        style = ":" if name.startswith("stock") else "-."
        ax.axhline(tps, linestyle=style, color="tab:gray" if name.startswith("stock") else "tab:red", linewidth=1)
        ax.annotate(
            f"{name} (run {i + 1}): {tps:.1f}", (0.13, tps), textcoords="offset points", xytext=(0, 3), fontsize=7
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks([0.125, 0.25, 0.5, 1.0], ["12.5%", "25%", "50%", "100%"])
    ax.set_xlabel("pool capacity (share of each layer's experts in GPU memory)")
    ax.set_ylabel("decode tokens/s (median)")
    r = reports[0]
    ax.set_title(
        f"{r['model_type']}, {r['moe_layers']} layers x {r['experts_per_layer']} experts, temp {r['temp']}: "
        f"solid measured, dashed the bound (resident + bytes / measured bandwidths)",
        fontsize=9,
    )
    ax.set_ylim(0, None)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    plot([json.loads(Path(p).read_text()) for p in sys.argv[2:]], Path(sys.argv[1]))
