"""Issue 62: where another client's request waits behind one address's unread streams.

`bench soak`'s greedy_client attack (daemon/bench/soak/gateway_attacks.py: 64 streamed
completions from 127.0.0.1, never read, then one completion from 127.0.0.2) on a copy of
the demo store at 25%, with the daemon's `status` polled every 0.25 s beside it: prints the
attack's figures (one JSON line), then each poll's active and queued counts and the
running requests' phase and tokens, which say what the other request waited for.

    python tests/bench/greedy_client_probe.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

from moestream.client.client import Client
from moestream.daemon.bench.soak.driver import DaemonProcess, reference_outputs, soak_cases
from moestream.daemon.bench.soak.gateway_attacks import GREEDY_STREAMS, GatewayProcess, greedy_client
from moestream.shared.settings import demo_store_path


def main() -> None:
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="greedyprobe"))
    store = root / "store"
    shutil.copytree(demo_store_path(), store)
    reference = reference_outputs(store, "0.25", soak_cases())
    daemon = DaemonProcess.start(store, root / "run", capacity="0.25")
    gateway = GatewayProcess(daemon.paths.dir, root / "gateway.log")
    polls: list[tuple] = []
    stop = threading.Event()

    def poll() -> None:
        with Client(daemon.paths) as c:
            t0 = time.monotonic()
            while not stop.is_set():
                r = c.status().requests
                running = [(i.phase, i.tokens, i.max_tokens) for i in r.running]
                polls.append((round(time.monotonic() - t0, 2), r.active, r.queued, running))
                time.sleep(0.25)

    watcher = threading.Thread(target=poll, daemon=True)
    try:
        watcher.start()
        print(json.dumps(greedy_client(gateway, reference, GREEDY_STREAMS)))
    finally:
        stop.set()
        watcher.join(5)
        gateway.stop()
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    for row in polls:
        print(row)


if __name__ == "__main__":
    main()
