"""The plan (`moestreamctl plan`): what fits, what it will cost, and the probes and bandwidth
measurements it is made from; off the serving path (the daemon never imports it)."""
