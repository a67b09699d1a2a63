"""`moestreamctl bench ...`: one module per benchmark; the drivers live in
`moestream.daemon.bench`, imported inside each command so that `--help` needs no MLX."""

from __future__ import annotations

import click

from . import agent, chat, decode, io, policy, predict, prefill, serve, session, soak, warmstart


@click.group()
def bench() -> None:
    """Benchmarks; each prints a table, or JSON with --json."""


for module in (io, policy, decode, prefill, serve, chat, warmstart, soak, predict, agent, session):
    bench.add_command(getattr(module, "bench_" + module.__name__.rsplit(".", 1)[1]))
