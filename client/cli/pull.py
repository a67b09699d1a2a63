"""`moestreamctl pull`: a Hugging Face model repository -> an expert store, as it downloads."""

from __future__ import annotations

from pathlib import Path

import click


def _repo_id(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from ...daemon.store.hub import is_repo_id

    if not is_repo_id(value):
        raise click.BadParameter(f"{value!r}: give a Hugging Face repository as OWNER/NAME (mlx-community/...)")
    return value


def pull_store(
    repo_id: str, out_dir: str | None = None, revision: str | None = None, keep_source: bool = False
) -> Path:
    """Pull `repo_id` into its store (progress on stderr); the store's folder. A pull that
    finished before returns at once; one that stopped continues."""
    from ...daemon.store.hub import default_store_dir
    from ...daemon.store.pull import pull_model
    from ...shared.store_format import StoreError

    out = Path(out_dir).expanduser() if out_dir else default_store_dir(repo_id, revision)
    try:
        manifest = pull_model(repo_id, out, revision=revision, keep_source=keep_source)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(
        f"{repo_id} at {manifest.source.get('revision', '?')[:12]}: {out} ({manifest.model_type}, "
        f"{len(manifest.layers)} MoE layers)",
        err=True,
    )
    return out


@click.command()
@click.argument("repo_id", callback=_repo_id)
@click.option("--revision", help="A branch, tag or commit of the repository [default: main].")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Folder for the expert store [default: $XDG_DATA_HOME/moestream/stores/OWNER--NAME, where XDG_DATA_HOME "
    "is ~/.local/share unless set; @REVISION added with --revision]. `start --model OWNER/NAME` looks there.",
)
@click.option(
    "--keep-source",
    is_flag=True,
    help="Keep the downloaded mlx-lm model folder beside the store (STORE.source). Without it each weight file is "
    "removed once it is in the store, so the disk holds the store and one weight file at most.",
)
def pull(repo_id: str, revision: str | None, out_dir: str | None, keep_source: bool) -> None:
    """Download a Hugging Face MoE model and convert it into an expert store as it arrives.

    REPO_ID is a model repository mlx-lm loads (mlx-community/Qwen3-30B-A3B-4bit). Its
    config is checked first: a model that is not MoE, or that mlx-lm cannot load, is
    refused before anything large is downloaded. Each file is checked against the hub's
    hash; each weight file goes into the store as soon as it is complete. Stopped, the
    same command continues where it stopped. `moestreamctl plan REPO_ID` says what the
    model needs before any download.
    """
    pull_store(repo_id, out_dir, revision, keep_source)
