"""`moestreamctl bench chat`: a multi-turn conversation through real daemons, the
prompt cache off and on."""

from __future__ import annotations

import json

import click

from ....daemon.bench.common import default_of
from ..values import StorePath, store_option
from .options import size_option


@click.command("chat")
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option("--turns", default=4, show_default=True, type=click.IntRange(2, 100))
@click.option(
    "--history-tokens", default=2048, show_default=True, type=click.IntRange(1, None), help="The first prompt's length."
)
@click.option(
    "--turn-tokens", default=32, show_default=True, type=click.IntRange(1, None), help="New tokens each turn adds."
)
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1, None), help="Answered per turn.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the conversation's tokens.")
@click.option("--capacity", help="The daemon's pool capacity (default: every expert).")
@click.option("--host-cache", help="The daemon's host-RAM tier (e.g. 20G).")
@click.option(
    "--mapped/--no-mapped", default=None, help="Force the mapped pool on or off (default: the daemon's auto)."
)
@click.option("--io-threads", default=default_of("io_threads"), show_default=True, type=click.IntRange(1, 256))
@click.option(
    "--warmup/--no-warmup",
    default=True,
    show_default=True,
    help="Before the timed turns, an untimed two-turn conversation of the same shape per daemon.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_chat(
    store,
    turns,
    history_tokens,
    turn_tokens,
    max_tokens,
    seed,
    capacity,
    host_cache,
    mapped,
    io_threads,
    warmup,
    as_json,
) -> None:
    """Time to the first token of each turn of a conversation with the daemon's prompt
    cache off and on, and the tokens it reused, side by side in one run."""
    from pathlib import Path

    from ....daemon.bench.chat import BenchChatSettings, format_report, run_bench_chat
    from ...client import ClientError

    store_option(store)
    size_option(host_cache, "--host-cache")
    settings = BenchChatSettings(
        store=Path(store),
        turns=turns,
        history_tokens=history_tokens,
        turn_tokens=turn_tokens,
        max_tokens=max_tokens,
        seed=seed,
        capacity=capacity,
        host_cache=host_cache,
        mapped=mapped,
        io_threads=io_threads,
        warmup=warmup,
    )
    try:
        report = run_bench_chat(settings, progress=lambda line: click.echo(line, err=True))
    except ClientError as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_report(report))
