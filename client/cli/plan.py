"""`moestreamctl plan`: what a store will cost and do, before anything of it is loaded (or,
for a Hugging Face repository, before anything of it is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ...shared.settings import SettingsError, parse_size
from .daemon import resolve_settings
from .values import StorePath, store_option


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value.strip().removesuffix("/s"))
    except SettingsError as e:
        raise click.BadParameter(str(e)) from None


@click.command()
@click.argument("repo_id", required=False)
@click.option("--model", "store", type=StorePath(), help="Expert store (`demo`, the default: the built-in demo model).")
@click.option("--revision", help="With REPO_ID: a branch, tag or commit of the repository [default: main].")
@click.option("--memory-budget", help="Size the pool to fit resident weights, pool and KV cache in this, e.g. 24G.")
@click.option("--host-cache", help="A host-RAM tier of this size between the store and the pool, e.g. 32G.")
@click.option("--capacity", help="Pool slots per MoE layer (16) or a fraction of each layer's experts (0.25, 25%).")
@click.option("--max-context", type=click.IntRange(16, None), help="Tokens of KV cache a memory budget keeps room for.")
@click.option(
    "--memory",
    metavar="SIZE",
    callback=_size,
    help="Plan for a Mac with this much unified memory (48G), not this machine: its GPU may use about 3/4 of it. "
    "With no --capacity or --memory-budget the pool is sized to fit that (this machine's memory otherwise) where "
    "every expert does not.",
)
@click.option(
    "--disk-bandwidth",
    metavar="RATE",
    callback=_size,
    help="The store's disk reads this many bytes/s (6G: 6 GiB/s), another Mac's SSD say (docs/mac-disks.md), "
    "instead of probing this machine's.",
)
@click.option(
    "--no-probe", is_flag=True, help="Use the last probe's bandwidths, compute and pool times (where there are any)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan(
    repo_id,
    store,
    revision,
    memory_budget,
    host_cache,
    capacity,
    max_context,
    memory,
    disk_bandwidth,
    no_probe,
    as_json,
) -> None:
    """Resident bytes, pool slots per layer, KV cache per 1k tokens, the expected hit rate
    (from the store's saved heat), the disk and link bandwidths, and the forecast decode
    tok/s and time to first token of a 2k-token prompt, each with its bound.

    REPO_ID (OWNER/NAME, instead of --model) plans a Hugging Face repository before
    anything large is downloaded: from its config and its weight files' headers, the
    store `moestreamctl pull REPO_ID` would write (its size on disk, resident weights and
    experts), and the same plan."""
    from ...daemon.planning.plan import format_plan, mac_memory, plan_shape, plan_store
    from ...daemon.pool.expert_pool import PoolCapacityError
    from ...shared.store_format import StoreError

    if repo_id is not None and store is not None:
        raise click.UsageError("give REPO_ID or --model STORE, not both")
    if revision is not None and repo_id is None:
        raise click.UsageError("--revision goes with REPO_ID")
    given = {"capacity": capacity, "memory_budget": memory_budget, "host_cache": host_cache, "max_context": max_context}
    settings = resolve_settings({"model": store, **given})
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    machine = mac_memory(memory) if memory is not None else None
    try:
        if repo_id is not None:
            from ...daemon.planning.repo import repo_shape
            from ...daemon.store.hub import is_repo_id

            if not is_repo_id(repo_id):
                raise click.BadParameter(f"{repo_id!r}: give a repository as OWNER/NAME", param_hint="REPO_ID")
            with repo_shape(repo_id, revision, say=say) as shape:
                p = plan_shape(
                    shape, settings, probe=not no_probe, progress=say, memory=machine, disk_bandwidth=disk_bandwidth
                )
        else:
            if settings.model is None:
                raise click.UsageError("no built-in demo model: give --model STORE")
            store_option(settings.model)
            p = plan_store(
                Path(settings.model),
                settings,
                probe=not no_probe,
                progress=say,
                memory=machine,
                disk_bandwidth=disk_bandwidth,
            )
    except PoolCapacityError as e:
        raise click.UsageError(str(e)) from None
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(p.to_dict()) if as_json else format_plan(p))
