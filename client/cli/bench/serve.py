"""`moestreamctl bench serve`: concurrent clients through the real daemon."""

from __future__ import annotations

import json

import click

from ....daemon.bench.common import default_of
from ..values import StorePath, store_option
from .options import size_option


@click.command("serve")
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option(
    "--clients",
    "clients",
    multiple=True,
    type=click.IntRange(1, 64),
    help="Concurrent clients per level (repeat); default 1 2 4 8.",
)
@click.option(
    "--requests",
    default=8,
    show_default=True,
    type=click.IntRange(1, 10000),
    help="Requests per level, shared by its clients (at least one per client).",
)
@click.option("--prompt-tokens", default=32, show_default=True, type=click.IntRange(1, None))
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1, None))
@click.option("--temp", default=1.0, show_default=True, type=click.FloatRange(0.0, 10.0), help="0: greedy.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the prompts and of each request.")
@click.option("--capacity", help="The daemon's pool capacity (default: every expert).")
@click.option("--host-cache", help="The daemon's host-RAM tier (e.g. 20G).")
@click.option(
    "--mapped/--no-mapped", default=None, help="Force the mapped pool on or off (default: the daemon's auto)."
)
@click.option("--io-threads", default=default_of("io_threads"), show_default=True, type=click.IntRange(1, 256))
@click.option(
    "--max-batch",
    default=0,
    show_default=True,
    type=click.IntRange(0, 256),
    help="The daemon's max_batch; 0: its default (up to 8, while its steps measure faster a token than lone "
    "ones); 1: requests take turns.",
)
@click.option(
    "--warmup/--no-warmup",
    default=True,
    show_default=True,
    help="One untimed request per client before each level (compiles a new batch size's kernels).",
)
@click.option(
    "--rounds",
    default=1,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Run every level this many times, every other round in reverse order, and report medians: "
    "levels run once each compare moments where the machine's pace drifts.",
)
@click.option(
    "--against-turns",
    is_flag=True,
    help="Also run every level through a second daemon whose requests take turns (max_batch 1), side by side "
    "in each round: the batch's gain, and a lone request's cost of batching.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_serve(
    store,
    clients,
    requests,
    prompt_tokens,
    max_tokens,
    temp,
    seed,
    capacity,
    host_cache,
    mapped,
    io_threads,
    max_batch,
    warmup,
    rounds,
    against_turns,
    as_json,
) -> None:
    """Aggregate tokens/s, time to first token and inter-token latency (p50, p99) of N
    concurrent clients through one real daemon, for each N in one run."""
    from pathlib import Path

    from ....daemon.bench.serve import BenchServeSettings, format_report, run_bench_serve
    from ...client import ClientError

    store_option(store)
    size_option(host_cache, "--host-cache")
    settings = BenchServeSettings(
        store=Path(store),
        clients=tuple(clients) or BenchServeSettings.clients,
        requests=requests,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        temp=temp,
        seed=seed,
        capacity=capacity,
        host_cache=host_cache,
        mapped=mapped,
        io_threads=io_threads,
        max_batch=max_batch,
        warmup=warmup,
        rounds=rounds,
        against_turns=against_turns,
    )
    try:
        report = run_bench_serve(settings, progress=lambda line: click.echo(line, err=True))
    except ClientError as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_report(report))
