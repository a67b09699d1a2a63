"""`moestreamctl bench policy`: replay a routing trace through every policy."""

from __future__ import annotations

import json
from typing import Any

import click

DEFAULT_CAPACITIES = (0.25, 0.5)


def _fraction(ctx: click.Context, param: click.Parameter, values: tuple[float, ...]) -> tuple[float, ...]:
    for v in values:
        if not 0.0 < v <= 1.0:
            raise click.BadParameter(f"{v} is not a fraction in (0, 1] of each layer's experts")
    return values or DEFAULT_CAPACITIES


@click.command("policy")
@click.option(
    "--trace",
    "trace_path",
    required=True,
    type=click.Path(exists=True),
    help="A trace.jsonl, or the folder holding it and its meta.json.",
)
@click.option(
    "--capacity",
    "capacities",
    type=float,
    multiple=True,
    callback=_fraction,
    help="Pool slots as a fraction of each layer's experts; repeatable [default: 0.25, 0.5].",
)
@click.option(
    "--prior",
    type=click.Choice(["loo", "none"]),
    default="loo",
    show_default=True,
    help="Heat prior for the policies: leave-one-out over the trace's requests, or none.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_policy(trace_path: str, capacities: tuple[float, ...], prior: str, as_json: bool) -> None:
    """Hit rates of every eviction policy and of Belady's MIN on a trace, and the share
    of the LRU-to-MIN gap each policy closes."""
    from ....daemon.bench.policy.replay import evaluate
    from ....daemon.bench.policy.trace import TraceError, load_trace

    try:
        trace = load_trace(trace_path)
    except TraceError as err:
        raise click.ClickException(str(err)) from None
    report = evaluate(trace, capacities, prior=prior)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        click.echo(format_table(report))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_table(report: dict[str, Any]) -> str:
    """The report as text: one row per policy, per capacity the mean hit rate over
    layers (all steps, decode steps) and the share of the LRU-to-MIN gap closed."""
    layers = ", ".join(str(i) for i in report["layers"])
    phases = report["phase_steps"]
    lines = [
        f"trace   {report['trace']}",
        f"model   {report['model']}",
        f"        {report['num_experts']} experts, top-{report['top_k']}, {len(report['layers'])} layers ({layers})",
        f"        {report['steps']} steps ({phases['prefill']} prefill, {phases['decode']} "
        f"decode), requests: {report['requests']}",
        f"prior   {report['prior']}",
        f"replay  {report['replay']}",
        "",
    ]
    results = report["results"]
    col = 27
    head = "".join(f"{'capacity %g (%d slots)' % (r['capacity_fraction'], r['slots']):<{col}}" for r in results)
    sub = "".join(f"{'hit':>6} {'decode':>7} {'gap':>7}{'':{col - 22}}" for _ in results)
    lines += [f"{'':12}{head}", f"{'policy':12}{sub}"]
    for name in results[0]["policies"]:
        cells = ""
        for r in results:
            p = r["policies"][name]
            cells += (
                f"{_rate(p['hit_rate']):>6} {_rate(p['decode_hit_rate']):>7} {_pct(p['gap_closed']):>7}{'':{col - 22}}"
            )
        lines.append(f"{name:12}{cells}")
    if all("static_hottest" in r for r in results):
        cells = "".join(
            f"{_rate(r['static_hottest']['hit_rate']):>6} {_rate(r['static_hottest']['decode_hit_rate']):>7} "
            f"{'':>7}{'':{col - 22}}"
            for r in results
        )
        lines.append(f"{'static':12}{cells}")
        lines.append("static: the prior's hottest experts, fixed per request and never moved (a mapped pool, no moves)")
    lines.append("")
    lines.append("hit: mean over layers of hits / routed experts; gap: (policy - lru) / (min - lru)")
    return "\n".join(line.rstrip() for line in lines)
