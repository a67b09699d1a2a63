"""`moestreamctl convert`: an mlx-lm model folder -> an expert store."""

from __future__ import annotations

import sys

import click


@click.command()
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the expert store.")
@click.option("--force", is_flag=True, help="Replace an existing store.")
@click.option(
    "--shard",
    metavar="I/N",
    callback=lambda ctx, param, value: _shard(value),
    help="Only the experts e % N == I of every layer: the store of rank I of an expert-parallel group of N "
    "(docs/scale-out.md), 1/N of the expert bytes.",
)
def convert(model_dir: str, out_dir: str, force: bool, shard: tuple[int, int] | None) -> None:
    """Convert an mlx-lm model folder into an expert store.

    MODEL_DIR is a folder as mlx-lm loads it (config.json, model*.safetensors,
    tokenizer files), e.g. a download of an mlx-community model. The experts are
    written one MoE layer at a time, so memory stays near one layer's size.
    """
    from ...daemon.store.convert import convert_model
    from ...shared.store_format import StoreError

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = click.progressbar(length=total, label="writing store", file=sys.stderr, width=30)
            bar.__enter__()
        bar.update(done - bar.pos)

    try:
        manifest = convert_model(model_dir, out_dir, force=force, progress=progress, shard=shard)
    except StoreError as e:
        raise click.ClickException(str(e)) from e
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    experts = sum(sum(map(manifest.holds, range(layer.num_experts))) for layer in manifest.layers)
    click.echo(
        f"wrote {out_dir}: {manifest.model_type}, {len(manifest.layers)} MoE layers, "
        f"{experts} experts{f' (shard {shard[0]}/{shard[1]})' if shard else ''}, "
        f"{len(manifest.resident_files)} resident file(s)"
    )


def _shard(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    index, slash, count = value.partition("/")
    if not (slash and index.isdigit() and count.isdigit() and int(count) >= 2 and int(index) < int(count)):
        raise click.BadParameter(f"{value!r}: give I/N, N at least 2 and I from 0 to N-1 (0/2, 1/2)")
    return int(index), int(count)
