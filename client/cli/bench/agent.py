"""`moestreamctl bench agent`: a coding agent's long prompt through the real daemon and
gateway: the status line, keep-alives, a cut request sent again, a duplicate."""

from __future__ import annotations

import json

import click

from ..values import StorePath, store_option


@click.command("agent")
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option("--capacity", default="0.25", show_default=True, help="The daemon's pool capacity.")
@click.option("--host-cache", default=None, help="The daemon's host-RAM tier (20G); default: none.")
@click.option("--prompt-tokens", default=16384, show_default=True, type=click.IntRange(64, None))
@click.option("--max-tokens", default=8, show_default=True, type=click.IntRange(1, None))
@click.option(
    "--cut-at",
    default=0.5,
    show_default=True,
    type=click.FloatRange(0.05, 0.95),
    help="When the cut request's connection is closed, and the duplicate sent: a share of the uncut request's "
    "time to the first token.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the prompts' token ids.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_agent(store, capacity, host_cache, prompt_tokens, max_tokens, cut_at, seed, as_json) -> None:
    """Streamed requests of a long prompt through a real daemon and gateway, as a coding
    agent sends them: the time to the status line, the longest gap without a byte before
    the first token, and the first token; a request cut during its prefill and sent
    again; the same request sent twice at once (one prefill, two answers)."""
    from pathlib import Path

    from ....daemon.bench.agent import BenchAgentSettings, format_report, run_bench_agent
    from ...client import ClientError

    store_option(store)
    settings = BenchAgentSettings(
        store=Path(store),
        capacity=capacity,
        host_cache=host_cache,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        cut_at=cut_at,
        seed=seed,
    )
    try:
        report = run_bench_agent(settings, progress=lambda line: click.echo(line, err=True))
    except (ClientError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_report(report))
