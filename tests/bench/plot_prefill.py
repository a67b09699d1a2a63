"""Draw a `bench prefill --json` report: time to first token against prompt length per
configuration, each partial pool's bound dashed in its colour.

    python tests/bench/plot_prefill.py REPORT_JSON OUT_PNG

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

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, config in enumerate(report["configs"]):
        rows = config["results"]
        color = "black" if config["name"] == "stock" else f"C{i}"
        tokens = [r["prompt_tokens"] for r in rows]
        ax.plot(tokens, [r["ttft_s"] for r in rows], marker="o", color=color, label=config["name"])
        bounds = [(r["prompt_tokens"], r["bound_s"]) for r in rows if r.get("bound_s") and r.get("min_bytes")]
        if bounds:
            ax.plot(*zip(*bounds), linestyle="--", color=color, alpha=0.7, label=f"{config['name']}: bound")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    bw = report["bandwidth"]
    ax.set_title(
        f"bench prefill, {report['device']}: store {bw['disk_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"link {bw['link_bytes_per_s'] / 1e9:.0f} GB/s",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
