"""`moestreamctl`: the command line. Imports no MLX, so `--help` and the daemon
commands answer fast; commands that need MLX import it inside their bodies."""

from __future__ import annotations

import click

from ... import __version__
from . import convert, daemon, dashboard, generate, heatmap, plan, pull, serve_openai, service
from .bench import bench


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moestreamctl")
def main() -> None:
    """Run Mixture-of-Experts models larger than memory.

    The non-expert weights stay resident; experts are streamed from an on-disk
    expert store into a bounded pool. Start with `moestreamctl generate "PROMPT"`.
    """


main.add_command(convert.convert)
main.add_command(pull.pull)
main.add_command(generate.generate)
main.add_command(plan.plan)
main.add_command(bench)
for c in daemon.COMMANDS:
    main.add_command(c)
main.add_command(service.service)
main.add_command(serve_openai.serve_openai)
main.add_command(dashboard.dashboard)
main.add_command(heatmap.heatmap)
