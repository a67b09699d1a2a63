"""Draw `bench serve --json` reports, one column each: aggregate tokens/s by client
count beside what the batch's decode steps alone would make; where each level's wall
went (the batch's counters: decode steps, joint prefills, joins, prefills alone, the
lone request, the rest); and one level's timeline (each request from sent to its first
token, then to its last).

    python tests/bench/plot_serve.py OUT_PNG REPORT_JSON [REPORT_JSON ...] [--timeline N]

Needs matplotlib (imported here only; the package does not depend on it), and not the package.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PARTS = (
    ("decode_s", "batch decode steps"),
    ("joint_prefill_s", "joint prefills"),
    ("join_s", "joins"),
    ("prefill_alone_s", "prefills alone"),
    ("solo_s", "the lone request"),
    # Reports since the batch-invariant batch: its steps (a request alone among them) and prefills.
    ("prefill_s", "prefills"),
)


def plot(reports: list[tuple[str, dict]], out: Path, timeline_clients: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(reports), figsize=(6.5 * len(reports), 12), squeeze=False)
    for col, (name, report) in enumerate(reports):
        levels = report["levels"]
        clients = [level["clients"] for level in levels]
        ax = axes[0][col]
        ax.plot(clients, [level["aggregate_tokens_per_s"] for level in levels], marker="o", label="aggregate")
        # bench serve's `steps_only_tokens_per_s`, worked out here for reports made before it.
        steps_only = [
            level.get("steps_only_tokens_per_s")
            or level["tokens"] / (level["batch"].get("decode_s", 0) + level["batch"].get("solo_s", 0))
            for level in levels
        ]
        ax.plot(clients, steps_only, marker="s", linestyle="--", label="tokens / (decode steps + lone steps)")
        for level in levels:
            ratio = level.get("aggregate_over_one_client")
            if ratio:
                ax.annotate(
                    f"{ratio:.2f}x",
                    (level["clients"], level["aggregate_tokens_per_s"]),
                    textcoords="offset points",
                    xytext=(4, -12),
                )
        ax.set(title=f"{name}: tokens/s by clients", xlabel="clients", ylabel="tokens/s", xticks=clients)
        ax.legend(fontsize=8)
        ax = axes[1][col]
        bottom = [0.0] * len(levels)
        for i, (key, label) in enumerate(PARTS):
            values = [level["batch"].get(key, 0.0) for level in levels]
            ax.bar([str(c) for c in clients], values, bottom=bottom, label=label, color=f"C{i}")
            bottom = [b + v for b, v in zip(bottom, values)]
        rest = [level["wall_s"] - b for level, b in zip(levels, bottom)]
        ax.bar([str(c) for c in clients], rest, bottom=bottom, label="the rest (clients, sends, checks)", color="0.8")
        ax.set(title=f"{name}: where each level's wall went", xlabel="clients", ylabel="seconds")
        ax.legend(fontsize=8)
        ax = axes[2][col]
        level = next((lv for lv in levels if lv["clients"] == timeline_clients), levels[-1])
        for row, (sent, first, done) in enumerate(sorted(level["timeline_s"])):
            ax.barh(row, first - sent, left=sent, color="C3", height=0.8)
            ax.barh(row, done - first, left=first, color="C0", height=0.8)
        ax.set(
            title=f"{name}: {level['clients']} clients' requests\n(red: sent to first token; blue: decoding)",
            xlabel="seconds from the level's start",
            ylabel="request (by time sent)",
        )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--timeline", type=int, default=4, help="the client count whose timeline is drawn")
    args = parser.parse_args()
    reports = []
    for path in args.reports:
        report = json.loads(Path(path).read_text())
        s = report["settings"]
        name = f"pool {s['capacity'] or 'all'}" + (f" + {s['host_cache']} host" if s.get("host_cache") else "")
        reports.append((name, report))
    plot(reports, Path(args.out), args.timeline)


if __name__ == "__main__":
    main()
