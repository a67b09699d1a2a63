"""The uncut request of `moestreamctl bench agent` (its first prompt, through a daemon and
a gateway) with the daemon and gateway of another source tree: how an earlier commit
served the same request ("the first token no later than today").

    mkdir -p /tmp/base/moestream && git archive dbc53d4 | tar -x -C /tmp/base/moestream
    cp _native*.so /tmp/base/moestream/
    python tests/bench/agent_ttft_probe.py --tree /tmp/base --model STORE --capacity 0.25 --out base.json

`--tree` goes first on the children's PYTHONPATH (the folder that holds `moestream/`);
the request is sent and timed by this tree's `daemon/bench/agent.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moestream.daemon.bench.agent import stream_completion
from moestream.shared.store_format import load_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", required=True, help="folder holding the other tree's moestream/")
    parser.add_argument("--model", required=True)
    parser.add_argument("--capacity", default="0.25")
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    manifest = load_manifest(args.model)
    vocab = int(manifest.config.get("text_config", manifest.config)["vocab_size"])
    rng = random.Random(args.seed)  # bench agent's prompts, in its order: the first is the uncut one
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(4)]
    env = dict(os.environ, PYTHONPATH=args.tree, MOESTREAM_MAX_CONTEXT=str(args.prompt_tokens + args.max_tokens + 64))
    runtime = Path(tempfile.mkdtemp(dir="/tmp", prefix="msprobe"))
    ctl = [sys.executable, "-m", "moestream.client.cli"]
    where = ["--runtime-dir", str(runtime)]
    started = subprocess.run(
        [*ctl, "start", "--model", args.model, "--capacity", args.capacity, *where], env=env, cwd="/"
    )
    assert started.returncode == 0
    log = open(runtime / "gateway.log", "wb")
    gateway = subprocess.Popen([*ctl, "serve-openai", "--port", "0", *where], env=env, cwd="/", stdout=log, stderr=log)
    try:
        url = None
        while url is None:
            time.sleep(0.1)
            for line in (runtime / "gateway.log").read_text().splitlines():
                if "OpenAI API on " in line:
                    url = line.split("OpenAI API on ", 1)[1].split(" ", 1)[0] + "/completions"
        body = {"model": "moestream", "max_tokens": args.max_tokens, "temperature": 0}
        stream_completion(url, body | {"prompt": prompts[3][:64]})
        uncut = stream_completion(url, body | {"prompt": prompts[0]})
    finally:
        gateway.terminate()
        gateway.wait(30)
        subprocess.run([*ctl, "stop", *where], env=env, cwd="/")
        shutil.rmtree(runtime, ignore_errors=True)
    report = {"tree": args.tree, "settings": vars(args), "uncut": uncut.to_dict(), "commands": [" ".join(sys.argv)]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["uncut"]))


if __name__ == "__main__":
    main()
