"""`moestreamctl bench soak`: fuzz, soak with cancellations, attacks, and kill -9 of heat writers,
at full counts, against real daemons on a copy of a store; prints the figures."""

from __future__ import annotations

import json

import click

from ..values import StorePath


@click.command("soak")
@click.option(
    "--model",
    "store",
    default=None,
    type=StorePath(exists=True),
    help="Expert store (`demo`, the default: the built-in demo model). A copy is used; the store is not touched.",
)
@click.option("--capacity", default="0.25", show_default=True, help="Pool capacity of the daemons.")
@click.option("--clients", default=8, show_default=True, type=click.IntRange(1, 256))
@click.option("--requests", default=200, show_default=True, type=click.IntRange(1, None), help="Requests per client.")
@click.option(
    "--cancel-frac",
    default=0.2,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Fraction of requests cancelled or disconnected mid-stream (half each).",
)
@click.option(
    "--kills",
    default=500,
    show_default=True,
    type=click.IntRange(0, None),
    help="kill -9 rounds: about half of the heat keeper, half of a publisher process, and up to 20 of the real daemon.",
)
@click.option("--fuzz", "fuzz", default=5000, show_default=True, type=click.IntRange(0, None), help="Fuzzed messages.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--attack-seconds",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0.0, None),
    help="Seconds of the non-reading client among the daemon's attacks; 0 runs none of the daemon's.",
)
@click.option(
    "--attacks",
    default="all",
    show_default=True,
    type=click.Choice(["all", "daemon", "gateway", "none"]),
    help="Which attacks run after the soak: the daemon's (idle connections, a non-reading client, oversized "
    "prompts, tiny sampling, connection churn; planted files and FIFOs in the prompt-cache folder), the gateway's "
    "(slowloris, connection caps, cross-origin and foreign-Host requests, oversized bodies, a greedy client, "
    "cached-token probing), both or none.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_soak(
    store, capacity, clients, requests, cancel_frac, kills, fuzz, seed, attack_seconds, attacks, as_json
) -> None:
    """Reliability figures: messages fuzzed, crashes, lost responses, RSS growth after
    warm-up, kills survived and invalid heat files. Exits 1 if any check fails."""
    from ....daemon.bench.common import parse_capacity
    from ....daemon.bench.soak.run import SoakSetupError, format_report, run_bench_soak
    from ....shared.settings import SettingsError, demo_store_path

    store = store or str(demo_store_path())
    try:
        parse_capacity(capacity)
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    try:
        report = run_bench_soak(
            store,
            capacity=capacity,
            clients=clients,
            requests=requests,
            cancel_frac=cancel_frac,
            kills=kills,
            fuzz=fuzz,
            seed=seed,
            attack_seconds=attack_seconds,
            attacks=attacks,
            echo=(lambda line: None) if as_json else (lambda line: click.echo(line, err=True)),
        )
    except SoakSetupError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report, indent=1) if as_json else format_report(report))
    if not report["ok"]:
        raise SystemExit(1)
