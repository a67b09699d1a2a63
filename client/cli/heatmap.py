"""`moestreamctl heatmap`: a store's heat (routings per expert, layers x experts) as a PNG."""

from __future__ import annotations

from pathlib import Path

import click

from ...shared.heat_file import group_usage, peek_usage, usage_path
from ...shared.settings import Settings, demo_store_path
from .daemon import resolve_settings
from .values import StorePath, store_option

# The demo model's recorded routing counts, shipped beside its store (daemon/plan.py reads them too).
DEMO_COUNTS = demo_store_path().parent / "routing_counts.json"


def _file(path: Path) -> tuple[dict[int, dict[int, int]], str]:
    try:
        return peek_usage(path), str(path)
    except FileNotFoundError:
        return {}, str(path)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot read the heat {path}: {e}") from None


def _group(folder: Path) -> tuple[dict[int, dict[int, int]], str]:
    try:
        counts, paths = group_usage(folder)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot read an expert-parallel group's heat in {folder}: {e}") from None
    return counts, f"{len(paths)} ranks' heat files ({', '.join(p.name for p in paths)}) in {folder}"


def _is_demo(store: Path) -> bool:
    return store_option(store).store_id == store_option(demo_store_path()).store_id


def heat_rows(store: Path, settings: Settings) -> tuple[list[list[int]], str]:
    """(rows of counts, where they come from): the store's saved heat, else the summed
    heat of the ranks of the last expert-parallel group that served it, else for the demo
    model its shipped counts."""
    manifest = store_option(store)
    folder = settings.heat_folder(store)
    path = usage_path(folder)
    sources = [lambda: _file(path), lambda: _group(folder)]
    if _is_demo(store):
        sources.append(lambda: _file(DEMO_COUNTS))
    for read in sources:
        counts, source = read()
        if any(sum(c.values()) for c in counts.values()):
            rows = [
                [counts.get(layer.ordinal, {}).get(e, 0) for e in range(layer.num_experts)] for layer in manifest.layers
            ]
            return rows, source
    raise click.ClickException(f"no heat saved for {store} yet ({path}): serve some requests first")


@click.command()
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), help="The PNG to write.")
@click.option("--cell", default=12, show_default=True, type=click.IntRange(2, 64), help="Pixels per layer and expert.")
def heatmap(store, out_file, cell) -> None:
    """Write the heat of STORE's experts as a PNG: a row per MoE layer, a column per
    expert, darker where routed more (one colour scale, its numbers below), titled with
    the store's name: the dashboard's heat map, for a file."""
    from ..dashboard.png import write_heat_png

    rows, source = heat_rows(Path(store), resolve_settings({"model": store}))
    # The name the gateway's APIs give the model (client/gateway/app.py model_id).
    name = "moestream-demo" if _is_demo(Path(store)) else Path(store).resolve().name
    total = sum(map(sum, rows))
    title = f"{name}: routings per expert, {len(rows)} layers x {len(rows[0])} experts, {total} in all"
    size = write_heat_png(Path(out_file), rows, title, cell)
    click.echo(f"{out_file}: {len(rows)} layers x {len(rows[0])} experts from {source} ({size} bytes)")
