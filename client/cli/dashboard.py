"""`moestreamctl dashboard`: open the gateway's live dashboard in a browser."""

from __future__ import annotations

import webbrowser

import click

from .serve_openai import DEFAULT_HOST, DEFAULT_PORT


@click.command()
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Where `moestreamctl serve-openai` listens.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535))
@click.option("--print-url", is_flag=True, help="Print the address instead of opening a browser.")
def dashboard(host, port, print_url) -> None:
    """Open the live dashboard (model, memory, requests, tokens/s, layers, heat map) that
    `moestreamctl serve-openai` serves at its root."""
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    if print_url or not webbrowser.open(url):
        click.echo(url)
        return
    click.echo(f"opened {url} (the gateway: `moestreamctl serve-openai`)", err=True)
