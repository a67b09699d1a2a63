"""The live dashboard the gateway serves at `GET /`: one bundled page that polls a JSON
route for the daemon's status, its tokens/s over the last minutes, the heat map, and the
pool's size over time with why it changed (the elastic pool's resizes).

    GET /                 the page (static/dashboard.html: HTML, CSS and JS in one file, no network)
    GET /dashboard/state  {status, heat, history, pool_sizes}: what the page draws

Like the rest of the gateway it is a thin client: the status comes from the daemon through
`moestream.client.Client`, the heat from the heat file the daemon's keeper writes.
"""

from .app import Dashboard, heat_map

__all__ = ["Dashboard", "heat_map"]
