"""`moestreamctl bench session`: a coding agent's session (a main agent, subagents beside
it, a cut request sent again) through real daemons and gateways, the prompt cache off and on."""

from __future__ import annotations

import json

import click

from ..values import StorePath, store_option


@click.command("session")
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option(
    "--session",
    "session_file",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="The recorded session (default: tests/data/agent_session_claude_code.json of a checkout).",
)
@click.option("--turns", default=3, show_default=True, type=click.IntRange(1, 100), help="The main agent's turns.")
@click.option(
    "--subagents",
    default=2,
    show_default=True,
    type=click.IntRange(0, 100),
    help="Subagents beside the main agent from its second turn on, one turn fewer each.",
)
@click.option(
    "--system-tokens",
    default=1200,
    show_default=True,
    type=click.IntRange(1, None),
    help="The prompt's tokens before the first user message (system prompt and tools); the system prompt is cut "
    "to fit.",
)
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1, None), help="Answered per turn.")
@click.option("--no-cut", is_flag=True, help="Leave out the request cut during its prefill and sent again.")
@click.option("--capacity", default=None, help="The daemons' pool capacity (default: every expert).")
@click.option("--host-cache", default=None, help="The daemons' host-RAM tier (20G); default: none.")
@click.option(
    "--context", default=None, type=click.IntRange(64, None), help="The daemons' max_context (default: the model's)."
)
@click.option(
    "--tool-choice",
    type=click.Choice(["auto", "any"]),
    default="auto",
    show_default=True,
    help="auto, as Claude Code sends it; any: every answer a tool call (a model that seldom calls tools by itself).",
)
@click.option(
    "--template-loss",
    is_flag=True,
    help="Instead: where the model's chat template makes a resent history part from the cached tokens (no daemon).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_session(
    store,
    session_file,
    turns,
    subagents,
    system_tokens,
    max_tokens,
    no_cut,
    capacity,
    host_cache,
    context,
    tool_choice,
    template_loss,
    as_json,
) -> None:
    """A Claude Code session replayed through a real daemon and gateway with the prompt
    cache off, then on: per request its prompt and cached tokens, time to first token and
    prefill seconds; the session's total prefill time, off against on. With
    --template-loss: the tokens the model's chat template loses when an agent's history
    comes back (a turn's prompt and answer against the next turn's prompt)."""
    from pathlib import Path

    from ....daemon.bench.session import DEFAULT_SESSION, BenchSessionSettings, format_report, run_bench_session
    from ...client import ClientError

    store_option(store)
    if template_loss:
        from ....daemon.bench.template_loss import format_losses, run_template_loss

        row = run_template_loss(store)
        click.echo(json.dumps(row) if as_json else format_losses([row]))
        return
    session = Path(session_file) if session_file else DEFAULT_SESSION
    if not session.is_file():
        raise click.ClickException(f"no recorded session at {session}: give one with --session")
    settings = BenchSessionSettings(
        store=Path(store),
        session=session,
        turns=turns,
        subagents=subagents,
        system_tokens=system_tokens,
        max_tokens=max_tokens,
        cut=not no_cut,
        capacity=capacity,
        host_cache=host_cache,
        context=context,
        tool_choice=tool_choice,
    )
    try:
        report = run_bench_session(settings, progress=lambda line: click.echo(line, err=True))
    except (ClientError, RuntimeError, OSError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_report(report))
