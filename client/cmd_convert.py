"""`moestreamctl convert`: an mlx-lm model folder -> an expert store."""

import click


@click.command()
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the expert store.")
@click.option("--force", is_flag=True, help="Overwrite an existing store.")
def convert(model_dir: str, out_dir: str, force: bool) -> None:
    """Convert an mlx-lm model folder into an expert store."""
    raise click.ClickException("not implemented yet")
