"""Attacks on the prompt cache's folder (`prompt_cache_dir`), each against real daemons
started on it, each followed by requests that must equal `generate --local`: what
`tests/test_prompt_cache.py` checks in process and `bench soak` reports.

  planted_cache_files  with the daemon stopped, its cache files changed: a symlink at a
                       cache file's name (to a copy of a good file), one at a temporary
                       file's name, a file of another prompt relabelled with this one's
                       tokens (its MAC fails), a file with bytes flipped; and, while the
                       next daemon runs, a symlink at the temporary name it writes next:
                       how many it refused and removed, whether the links' targets are
                       untouched, whether every answer was exact and the good file served
  cache_fifo           FIFOs at a cache file's, a temporary file's and the day's budget
                       file's names: how long the daemon took to be ready (and without
                       them), whether it served exactly, how long SIGTERM took to stop it

The daemons write their key under a private XDG_STATE_HOME. No MLX here: a file's header
is read with the standard library.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from ....client.client import Client, ClientError
from .driver import DaemonProcess, Reference

# The files' suffix and the day's budget file (daemon/model/prompt_cache.py, which imports MLX).
SUFFIX = ".safetensors"
BUDGET_FILE = "written-today.json"
CACHED_WITHIN_S = 60.0  # a finished request's file is written when the engine is idle


@dataclass
class PlantedCacheFiles:
    planted: int
    # Of them: refused and removed by the daemon (`status`' disk_skipped, and gone from the folder).
    refused: int
    removed: int
    # Link targets the daemon wrote through (must be 0).
    targets_changed: int
    requests: int
    exact: int
    # The untouched file, read back and served (its tokens reported cached).
    good_file_served: bool
    ok: bool


@dataclass
class CacheFifo:
    fifos: int
    ready_s: float
    ready_without_s: float
    exact: bool
    # The cache file written again where the FIFO was; FIFOs still in the folder after.
    rewritten: bool
    fifos_left: int
    stop_s: float
    exit_status: int | None
    ok: bool


def _header(data: bytes) -> tuple[int, dict[str, Any]]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def _with_tokens(data: bytes, tokens: str) -> bytes:
    """A cache file's bytes with its metadata's token list replaced (its MAC kept)."""
    n, header = _header(data)
    header["__metadata__"]["0.tokens"] = tokens
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data[8 + n :]


def _tokens_of(path: Path) -> str:
    return _header(path.read_bytes())[1]["__metadata__"]["0.tokens"]


class _Cases:
    """Requests of reference cases to one daemon: whether each answer was exact."""

    def __init__(self, reference: Mapping[tuple[str, int], Reference]) -> None:
        self.reference = reference
        self.requests = self.exact = 0

    def ask(self, daemon: DaemonProcess, case: tuple[str, int]) -> int:
        """Ask for `case`; returns the prompt tokens the daemon served from a cache."""
        with Client(daemon.paths, timeout=60) as c:
            done = c.complete(case[0], max_tokens=case[1])
        ref = self.reference[case]
        self.requests += 1
        self.exact += tuple(done.tokens) == ref.tokens and done.text == ref.text
        return done.stats.cached_tokens


def _start(store: Path, runtime: Path, folder: Path, capacity: str) -> DaemonProcess:
    env = {"XDG_STATE_HOME": str(runtime.parent / "state")}
    return DaemonProcess.start(store, runtime, capacity=capacity, flags={"prompt_cache_dir": str(folder)}, env=env)


def _wait(what: Callable[[], bool], seconds: float = CACHED_WITHIN_S) -> bool:
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _disk(daemon: DaemonProcess) -> dict[str, Any]:
    with Client(daemon.paths, timeout=30) as c:
        return c.status().prompt_cache or {}


def _write_files(
    store: Path, root: Path, folder: Path, cases: _Cases, chosen: list[tuple[str, int]], capacity: str
) -> tuple[list[Path], float]:
    """A daemon that answers each of `chosen` and writes its cache file: the files, in
    order, and how long the daemon took to be ready."""
    tic = time.monotonic()
    files: list[Path] = []
    with _start(store, root / "rw", folder, capacity) as daemon:
        ready = time.monotonic() - tic
        for case in chosen:
            cases.ask(daemon, case)
            if not _wait(lambda: len(list(folder.glob("*" + SUFFIX))) > len(files)):
                raise RuntimeError(f"the daemon wrote no cache file for {case[0]!r}: {daemon.tail()}")
            (new,) = set(folder.glob("*" + SUFFIX)) - set(files)
            files.append(new)
        daemon.stop(60.0)
    return files, ready


def _three_cases(reference: Mapping[tuple[str, int], Reference]) -> list[tuple[str, int]]:
    """Three cases of different prompts, each its shortest answer."""
    by_prompt: dict[str, tuple[str, int]] = {}
    for prompt, max_tokens in sorted(reference):
        by_prompt.setdefault(prompt, (prompt, max_tokens))
    return list(by_prompt.values())[:3]


def planted_cache_files(
    store: Path, root: Path, reference: Mapping[tuple[str, int], Reference], *, capacity: str = "0.25"
) -> dict[str, Any]:
    """See the module's docstring; `root` is a fresh folder of the caller's."""
    folder, outside = root / "pc", root / "outside"
    outside.mkdir()
    cases = _Cases(reference)
    chosen = _three_cases(reference)
    (corrupt, relabelled, good), _ = _write_files(store, root, folder, cases, chosen, capacity)
    good_bytes = good.read_bytes()
    flipped = bytearray(corrupt.read_bytes())
    flipped[-100] ^= 0x40  # in the last tensor's bytes
    corrupt.write_bytes(bytes(flipped))
    relabelled.write_bytes(_with_tokens(good_bytes, _tokens_of(relabelled)))
    targets = {outside / name: good_bytes for name in ("linked", "tmp-linked", "tmp-linked-live")}
    for path, data in targets.items():
        path.write_bytes(data)
    prefix = good.name.rsplit("-", 1)[0]
    links = [folder / f"{prefix}-{'0' * 32}{SUFFIX}", folder / (good.name + ".tmp")]
    for link, target in zip(links, targets):
        link.symlink_to(target)
    planted = [corrupt, relabelled, *links]
    with _start(store, root / "rp", folder, capacity) as daemon:
        # The next file written is the corrupt one's, once refused: its temporary name a link.
        live = folder / (corrupt.name + ".tmp")
        live.symlink_to(outside / "tmp-linked-live")
        planted.append(live)
        cached = [cases.ask(daemon, case) for case in chosen]
        rewritten = _wait(lambda: corrupt.is_file() and relabelled.is_file() and not live.is_symlink())
        disk = _disk(daemon)
        daemon.stop(60.0)
    left = {p for p in planted if p.is_symlink()} | {p for p in (corrupt, relabelled) if not rewritten}
    changed = sum(path.read_bytes() != data for path, data in targets.items())
    tmp_links = [p for p in planted if p.name.endswith(".tmp")]
    out = PlantedCacheFiles(
        planted=len(planted),
        # A link at a temporary name is removed unread (at the start, or before a write):
        # the daemon counts it nowhere, so it counts here as refused once gone.
        refused=int(disk["disk_skipped"]) + sum(not p.is_symlink() for p in tmp_links),
        removed=len(planted) - len(left),
        targets_changed=changed,
        requests=cases.requests,
        exact=cases.exact,
        good_file_served=cached[2] > 0 and disk["disk_loaded"] == 1,
        ok=False,
    )
    out = replace(
        out,
        ok=bool(
            out.refused == out.removed == out.planted
            and changed == 0
            and out.exact == out.requests
            and out.good_file_served
        ),
    )
    return asdict(out)


def cache_fifo(
    store: Path, root: Path, reference: Mapping[tuple[str, int], Reference], *, capacity: str = "0.25"
) -> dict[str, Any]:
    """See the module's docstring; `root` is a fresh folder of the caller's."""
    folder = root / "pc"
    cases = _Cases(reference)
    case = _three_cases(reference)[0]
    (written,), ready_without = _write_files(store, root, folder, cases, [case], capacity)
    written.unlink()
    fifos = [written, folder / (written.name + ".tmp"), folder / BUDGET_FILE]
    (folder / BUDGET_FILE).unlink(missing_ok=True)
    for path in fifos:
        os.mkfifo(path, 0o600)
    tic = time.monotonic()
    daemon = _start(store, root / "rf", folder, capacity)
    ready = time.monotonic() - tic
    try:
        cases.ask(daemon, case)
        rewritten = _wait(written.is_file)
    finally:
        # As `moestreamctl stop` does: the shutdown message, then wait for the process.
        tic = time.monotonic()
        status: int | None = None
        try:
            with Client(daemon.paths, timeout=30) as c:
                c.shutdown()
            status = daemon.proc.wait(60.0)
        except (ClientError, subprocess.TimeoutExpired):  # the figure says so
            daemon.kill()
        stop_s = time.monotonic() - tic
    out = CacheFifo(
        fifos=len(fifos),
        ready_s=ready,
        ready_without_s=ready_without,
        exact=cases.exact == cases.requests == 2,
        rewritten=rewritten,
        fifos_left=sum(p.is_fifo() for p in folder.iterdir()),
        stop_s=stop_s,
        exit_status=status,
        ok=False,
    )
    out = replace(out, ok=bool(out.exact and rewritten and out.fifos_left == 0 and status == 0))
    return asdict(out)


def run_cache_attacks(
    store: Path, root: Path, reference: Mapping[tuple[str, int], Reference], *, capacity: str = "0.25"
) -> dict[str, Any]:
    """Both attacks above, each on daemons of its own on `store` under `root`; `ok` when each is."""
    parts = {"planted_cache_files": planted_cache_files, "cache_fifo": cache_fifo}
    out: dict[str, Any] = {}
    for name, attack in parts.items():
        (root / name).mkdir(parents=True)
        try:
            out[name] = attack(store, root / name, reference, capacity=capacity)
        finally:
            shutil.rmtree(root / name, ignore_errors=True)
    out["ok"] = all(part["ok"] for part in out.values())
    return out
