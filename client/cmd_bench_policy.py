"""`moestreamctl bench policy`: replay a routing trace through every policy."""

import click


@click.command("policy")
@click.option("--trace", required=True, type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True)
def bench_policy(trace: str, as_json: bool) -> None:
    """Hit rates of every eviction policy and of Belady's MIN on a trace."""
    raise click.ClickException("not implemented yet")
