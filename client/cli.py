"""`moestreamctl`: the command line. Imports no MLX, so `--help` and the daemon
commands answer fast; commands that need MLX import it inside their bodies."""

from __future__ import annotations

import click

from moestream import __version__
from moestream.client import (
    cmd_bench_decode,
    cmd_bench_io,
    cmd_bench_policy,
    cmd_bench_predict,
    cmd_bench_soak,
    cmd_bench_warmstart,
    cmd_convert,
    cmd_daemon,
    cmd_generate,
    cmd_serve_openai,
    cmd_service,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moestreamctl")
def main() -> None:
    """Run Mixture-of-Experts models larger than memory.

    The non-expert weights stay resident; experts are streamed from an on-disk
    expert store into a bounded pool. Start with `moestreamctl generate "PROMPT"`.
    """


@main.group()
def bench() -> None:
    """Benchmarks; each prints a table, or JSON with --json."""


main.add_command(cmd_convert.convert)
main.add_command(cmd_generate.generate)
bench.add_command(cmd_bench_io.bench_io)
bench.add_command(cmd_bench_policy.bench_policy)
bench.add_command(cmd_bench_decode.bench_decode)
bench.add_command(cmd_bench_warmstart.bench_warmstart)
bench.add_command(cmd_bench_soak.bench_soak)
bench.add_command(cmd_bench_predict.bench_predict)
for c in cmd_daemon.COMMANDS:
    main.add_command(c)
main.add_command(cmd_service.service)
main.add_command(cmd_serve_openai.serve_openai)


if __name__ == "__main__":
    main()
