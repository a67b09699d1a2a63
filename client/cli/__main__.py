"""`python -m moestream.client.cli`: the same as `moestreamctl`."""

from . import main

main(prog_name="moestreamctl")
