"""`moestreamctl plan`: what a store will cost and do, before anything of it is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ...shared.settings import Settings, SettingsError
from .values import StorePath, store_option


@click.command()
@click.option("--model", "store", type=StorePath(), help="Expert store (`demo`, the default: the built-in demo model).")
@click.option("--memory-budget", help="Size the pool to fit resident weights, pool and KV cache in this, e.g. 24G.")
@click.option("--host-cache", help="A host-RAM tier of this size between the store and the pool, e.g. 32G.")
@click.option("--capacity", help="Pool slots per MoE layer (16) or a fraction of each layer's experts (0.25, 25%).")
@click.option("--max-context", type=click.IntRange(16, None), help="Tokens of KV cache a memory budget keeps room for.")
@click.option(
    "--no-probe", is_flag=True, help="Use the last probe's bandwidths, compute and pool times (where there are any)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan(store, memory_budget, host_cache, capacity, max_context, no_probe, as_json) -> None:
    """Resident bytes, pool slots per layer, KV cache per 1k tokens, the expected hit rate
    (from the store's saved heat), the disk and link bandwidths, and the forecast decode
    tok/s and time to first token of a 2k-token prompt, each with its bound."""
    from ...daemon.planning.plan import format_plan, plan_store
    from ...daemon.pool.expert_pool import PoolCapacityError

    given = {"capacity": capacity, "memory_budget": memory_budget, "host_cache": host_cache, "max_context": max_context}
    try:
        settings = Settings.resolve({"model": store, **given})
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    if settings.model is None:
        raise click.UsageError("no built-in demo model: give --model STORE")
    store = settings.model
    store_option(store)
    try:
        p = plan_store(Path(store), settings, probe=not no_probe, progress=lambda line: click.echo(line, err=True))
    except PoolCapacityError as e:
        raise click.UsageError(str(e)) from None
    click.echo(json.dumps(p.to_dict()) if as_json else format_plan(p))
