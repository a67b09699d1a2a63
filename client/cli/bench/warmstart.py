"""`moestreamctl bench warmstart`: restart the daemon with and without AUTOPIN."""

from __future__ import annotations

import json

import click

from ....daemon.bench.common import default_of
from ..values import StorePath, store_option
from .options import size_option


@click.command("warmstart")
@click.option("--model", "store", required=True, type=StorePath(exists=True), help=StorePath.HELP)
@click.option("--capacity", default="0.25", show_default=True, help="Pool capacity of both daemons.")
@click.option("--autopin-frac", default=default_of("autopin_frac"), show_default=True, type=click.FloatRange(0.0, 1.0))
@click.option("--prompt", default="def fibonacci(n):", show_default=True)
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(1, None))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, None))
@click.option("--io-threads", default=default_of("io_threads"), show_default=True, type=click.IntRange(1, 256))
@click.option(
    "--mapped",
    is_flag=True,
    help="Both daemons run a mapped pool (see `start --mapped`): autopin places the hottest experts in GPU memory.",
)
@click.option(
    "--host-cache",
    help="Both daemons keep a host-RAM tier of this size (e.g. 20G); the pinned one fills it with the hottest "
    "experts before it is ready.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_warmstart(
    store, capacity, autopin_frac, prompt, tokens, rounds, io_threads, mapped, host_cache, as_json
) -> None:
    """Time to the first TOKENS tokens after a daemon restart, cold vs pinned.

    Starts real daemons (each in its own runtime folder) and leaves the store's
    pool_usage.json as it found it."""
    from pathlib import Path

    from ....daemon.bench.warmstart import format_report, run_bench_warmstart
    from ...client import ClientError

    # Clear errors before the store's heat is set aside or any daemon starts.
    store_option(store)
    size_option(host_cache, "--host-cache")
    try:
        report = run_bench_warmstart(
            Path(store),
            capacity=capacity,
            autopin_frac=autopin_frac,
            prompt=prompt,
            tokens=tokens,
            rounds=rounds,
            io_threads=io_threads,
            mapped=mapped,
            host_cache=host_cache,
            progress=lambda line: click.echo(line, err=True),
        )
    except ClientError as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_report(report))
