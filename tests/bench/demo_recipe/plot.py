"""Draw a training run's loss curves from its metrics.json.

    python -m demo_recipe.plot METRICS_JSON OUT_PNG

Needs matplotlib, imported only when a plot is drawn, so that training runs where it is
not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_metrics(metrics: dict[str, Any], path: str | Path) -> None:
    """Write a PNG of the training and validation losses (next token and MTP)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = metrics["train_curve"]
    steps = curve["step"]
    window = max(1, len(steps) // 100)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(steps, _smooth(curve["ce"], window), label="train: next token", color="tab:blue")
    ax.plot(steps, _smooth(curve["mtp_ce"], window), label="train: MTP (token after next)", color="tab:orange")
    val = curve.get("val") or []
    if val:
        ax.plot(
            [v["step"] for v in val], [v["loss"] for v in val], "o-", ms=3, label="validation: next token", color="navy"
        )
        ax.plot(
            [v["step"] for v in val], [v["mtp_loss"] for v in val], "o-", ms=3, label="validation: MTP", color="darkred"
        )
    chat = curve.get("chat_val") or []
    if chat:
        ax.plot(
            [v["step"] for v in chat], [v["loss"] for v in chat], "s--", ms=3, label="validation chat: next token",
            color="green",
        )  # fmt: skip
    selection = metrics.get("selection")
    if selection:
        ax.axvline(selection["step"], color="gray", ls=":", label=f"kept ({selection['rule']})")
    final = metrics.get("validation")
    title = "demo qwen3_moe on the Python standard library"
    if final:
        title += (
            f"\nval loss {final['loss']:.3f} (ppl {final['ppl']:.1f}), "
            f"MTP next-next acc {final['mtp_next_next_acc']:.3f}"
        )
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m demo_recipe.plot METRICS_JSON OUT_PNG", file=sys.stderr)
        return 2
    metrics = json.loads(Path(args[0]).read_text())
    try:
        plot_metrics(metrics, args[1])
    except ModuleNotFoundError as e:
        print(f"error: {e.name} is not installed; `pip install matplotlib` and run again", file=sys.stderr)
        return 1
    print(f"wrote {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
