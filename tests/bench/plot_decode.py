"""Draw a `bench decode --json` report: tokens/s per configuration against its bound.

    python tests/bench/plot_decode.py REPORT_JSON OUT_PNG

Needs matplotlib (imported here only; the package itself does not depend on it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [r["name"] for r in rows]
    tps = [r["tokens_per_s"] for r in rows]
    lows = [r["tokens_per_s"] - min(r["tokens_per_s_runs"]) for r in rows]
    highs = [max(r["tokens_per_s_runs"]) - r["tokens_per_s"] for r in rows]
    bounds = [r.get("bound_tokens_per_s") for r in rows]
    colors = [
        "tab:gray"
        if n.startswith("stock")
        else "tab:red"
        if n.startswith("naive")
        else "tab:green"
        if n.endswith("+host")
        else "tab:cyan"
        if n.endswith("+host:slots")
        else "tab:purple"
        if "+mapped" in n
        else "tab:blue"
        for n in names
    ]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    x = range(len(rows))
    ax.bar(x, tps, color=colors, yerr=[lows, highs], capsize=3, label="tokens/s (median, range of runs)")
    ax.scatter(
        x,
        bounds,
        marker="_",
        s=600,
        color="black",
        zorder=3,
        label="bound (resident median + bytes / measured bandwidths)",
    )
    best = [r.get("best_bound_tokens_per_s") for r in rows]
    if any(b is not None for b in best):
        ax.scatter(
            x,
            [b if b is not None else float("nan") for b in best],
            marker="_",
            s=600,
            color="tab:orange",
            zorder=3,
            label="bound from the fastest resident round (strictest)",
        )
        bounds = bounds + best
    for i, r in enumerate(rows):
        ax.annotate(
            f"{r['hit_rate']:.3f}", (i, tps[i]), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7
        )
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(
        f"{report['model_type']}, {report['moe_layers']} layers x {report['experts_per_layer']} experts, "
        f"temp {report['temp']}: disk {report['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"link {report['link_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (numbers: pool hit rate)",
        fontsize=9,
    )
    ax.set_ylim(0, 1.3 * max(max(tps), max(b for b in bounds if b is not None)))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
