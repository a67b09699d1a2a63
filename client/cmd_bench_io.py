"""`moestreamctl bench io`: the native read engine against fio."""

import click


@click.command("io")
@click.option("--store", required=True, type=click.Path(file_okay=False))
@click.option("--threads", default=4, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_io(store: str, threads: int, as_json: bool) -> None:
    """Read a random sample of experts through the engine and through fio."""
    raise click.ClickException("not implemented yet")
