"""`python -m moestream.client.cli`: the same as `moestreamctl`."""

from moestream.client.cli import main

main(prog_name="moestreamctl")
